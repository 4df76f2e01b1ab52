"""Command-line flags generated from the config schema, so `--help` cannot drift from it.

Every field of `EngineArgs` (and, for `fleetserve serve`, of `AppConfig`) becomes a
flag spelled as vLLM spells it (`max_num_seqs` -> `--max-num-seqs`), with the field's
`description` as its help, its default and its choices. A field added to the schema
gets its flag and help with no change here: bools become `--x/--no-x`, Literals get
`choices`, numbers and strings their type, anything else (dicts, lists, nested
models) takes a JSON value. Flags not given stay unset (argparse.SUPPRESS), so the
schema's defaults (or a YAML file) apply.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Iterator, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from fleetserve.replica.engine.engine_args import EngineArgs

# Nested application fields that keep vLLM's / the README's short spelling.
FLAG_NAMES = {
    "http.host": "--host",
    "http.port": "--port",
    "grpc.port": "--grpc-port",
    "http.allowed_origins": "--allowed-origins",
    "http.allow_credentials": "--allow-credentials",
    "http.allowed_methods": "--allowed-methods",
    "http.allowed_headers": "--allowed-headers",
    "grpc.enabled": "--grpc",
    "http.return_tokens_as_token_ids": "--return-tokens-as-token-ids",
    # vLLM's tracing flags
    "tracing.otlp_traces_endpoint": "--otlp-traces-endpoint",
    "tracing.collect_detailed_traces": "--collect-detailed-traces",
    "tracing.otlp_traces_protocol": "--otlp-traces-protocol",
    # A nested model given whole, as vLLM's JSON flag (not walked field by field).
    "speculative_config": "--speculative-config",
    # P/D: `fleetserve serve --pd --num-prefill-replicas 1 --num-decode-replicas 1
    # --kv-connector ray_object_store`
    "pd.enabled": "--pd",
    "pd.prefill.num_replicas": "--num-prefill-replicas",
    "pd.decode.num_replicas": "--num-decode-replicas",
    "pd.connector": "--kv-connector",
    # One JSON value, as vLLM's --kv-transfer-config (not a flag per sub-field).
    "kv_transfer_config": "--kv-transfer-config",
    "engine.kv_transfer_config": "--kv-transfer-config",
}


# Fields given as several words, as vLLM's flags (`--lora-modules a=/p b=/q`); the schema's
# validator parses each word.
NARGS_FIELDS = {"lora_modules": "NAME=PATH", "lora_roots": "DIR"}


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e


def _unwrap_optional(ann: Any) -> Any:
    if typing.get_origin(ann) in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def schema_fields(
    model: type[BaseModel], prefix: str = "", skip: tuple[str, ...] = ()
) -> Iterator[tuple[str, FieldInfo, Any]]:
    """(dotted path, field, unwrapped type) of every leaf field; nested models are walked."""
    for name, field in model.model_fields.items():
        path = prefix + name
        if path in skip:
            continue
        ann = _unwrap_optional(field.annotation)
        if _is_model(ann) and path not in FLAG_NAMES:
            yield from schema_fields(ann, path + ".", skip)
        else:
            yield path, field, ann


def _help(field: FieldInfo, path: str) -> str:
    text = field.description or f"the {path} setting"
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        default = default.model_dump_json()
    shown = "unset" if default is None else default
    return f"{text} [default: {shown}]".replace("%", "%%")


def add_schema_flags(group, model: type[BaseModel], prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """Add one flag per leaf field of `model` to `group`; returns their dests (dotted paths)."""
    dests = []
    for path, field, ann in schema_fields(model, prefix, skip):
        flag = FLAG_NAMES.get(path) or "--" + path.replace(".", "-").replace("_", "-")
        kwargs: dict[str, Any] = {"dest": path, "default": argparse.SUPPRESS, "help": _help(field, path)}
        if ann is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(ann) in (Union, types.UnionType) and set(typing.get_args(ann)) - {type(None)} == {
            str,
            tuple[str, ...],
        }:
            kwargs.update(nargs="+", type=str, metavar="NAME")  # one name or several, as vLLM's
        elif path.rsplit(".", 1)[-1] in NARGS_FIELDS:
            kwargs.update(nargs="+", type=str, metavar=NARGS_FIELDS[path.rsplit(".", 1)[-1]])
        elif typing.get_origin(ann) is Literal:
            choices = typing.get_args(ann)
            kwargs.update(choices=choices, type=type(choices[0]))
        elif ann in (int, float, str):
            kwargs.update(type=ann, metavar=path.rsplit(".", 1)[-1].upper())
        else:
            kwargs.update(type=_json_value, metavar="JSON")
        group.add_argument(flag, **kwargs)
        dests.append(path)
    return dests


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (vLLM flag names)")
    add_schema_flags(group, EngineArgs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields given on the command line (a positional model tag included)."""
    given = vars(args)
    out = {k: given[k] for k in EngineArgs.model_fields if k in given}
    if given.get("model_tag"):
        out.setdefault("model", given["model_tag"])
    return out


def nested_overrides(args: argparse.Namespace, dests: list[str]) -> dict[str, Any]:
    """The given flags among `dests` as a nested dict (`http.port` -> {"http": {"port": ...}})."""
    given = vars(args)
    out: dict[str, Any] = {}
    for dest in dests:
        if dest not in given:
            continue
        *parents, leaf = dest.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = given[dest]
    return out


__all__ = ["add_engine_flags", "add_schema_flags", "engine_kwargs", "nested_overrides", "schema_fields"]
