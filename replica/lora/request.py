"""What names a LoRA adapter, without torch: `LoRARequest` (vLLM's offline API) and the
`--lora-modules` entries an engine serves."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.replica.lora.paths import LoRAFileError

# How long an engine may take to load a LoRA adapter at run time, by default
# (--lora-load-timeout: its checks, reading and converting its weights, off the step loop).
LORA_LOAD_TIMEOUT_S = 120.0

# The linear layers an adapter may target (the Llama family's names in HF and PEFT).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAModulePath(BaseModel):
    """One `--lora-modules` entry: `name=path` or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: Optional[str] = None

    @classmethod
    def parse(cls, value: Any) -> "LoRAModulePath":
        if isinstance(value, LoRAModulePath):
            return value
        if isinstance(value, dict):
            return cls(**value)
        if not isinstance(value, str):
            raise ValueError(f"lora_modules: expected name=path or a JSON object, got {value!r}")
        text = value.strip()
        if text.startswith("{"):
            try:
                return cls(**json.loads(text))
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: {text!r} is not valid JSON: {e}") from None
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected name=path, got {text!r}")
        return cls(name=name.strip(), path=path.strip())


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's offline handle on an adapter: `LLM.generate(prompts, params,
    lora_request=LoRARequest("sql", 1, "/path/to/adapter"))`. `lora_int_id` is a positive id
    unique per adapter; `lora_path` a PEFT folder (adapter_config.json +
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be a positive integer, got {self.lora_int_id!r}")


def adapter_digest(path: str) -> str:
    """A short digest of an adapter folder's config and weights. An adapter's KV blocks are
    salted with `name@digest`, so blocks cached for an adapter never serve another one that
    reuses its name (an unload and a load of new weights, a restart on a persistent KV store)."""
    h = hashlib.blake2b(digest_size=8)
    for fname in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        try:
            with open(os.path.join(path, fname), "rb") as f:
                h.update(fname.encode())
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except FileNotFoundError:
            continue
    return h.hexdigest()


def read_adapter_config(path: str, label: Optional[str] = None) -> dict:
    """A PEFT adapter folder's adapter_config.json, checked for what fleetserve can apply;
    ValueError naming the problem otherwise (lora.paths.LoRAFileError when the folder or the
    file cannot be read). `label` names the adapter in the messages (default: the path; a
    client's load gives its name: a client hears nothing of the file system). (The weights
    are checked when loaded.)"""
    where = f"LoRA adapter {path!r}"
    if not os.path.isdir(path):
        raise LoRAFileError(f"{where}: no such folder")
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAFileError(
            f"{where}: no adapter_config.json (a PEFT adapter folder holds "
            "adapter_config.json and adapter_model.safetensors)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise LoRAFileError(f"{where}: adapter_config.json cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{label or where}: adapter_config.json is not valid JSON: {e}") from None
    where = label or where
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: adapter_config.json is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"{where}: peft_type {kind!r} is not LORA")
    refused = [
        (key, why)
        for key, bad, why in (
            ("use_dora", bool(cfg.get("use_dora")), "DoRA"),
            ("bias", cfg.get("bias", "none") not in (None, "none"), "trained biases"),
            ("modules_to_save", bool(cfg.get("modules_to_save")), "fully trained modules (modules_to_save)"),
            ("alpha_pattern", bool(cfg.get("alpha_pattern")), "per-module alphas (alpha_pattern)"),
            ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D) weights"),
            ("layers_to_transform", cfg.get("layers_to_transform") is not None, "layers_to_transform"),
        )
        if bad
    ]
    if refused:
        raise ValueError(
            f"{where}: {refused[0][1]} ({refused[0][0]} in adapter_config.json) "
            "not supported; a plain LoRA of the attention and MLP projections is"
        )
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise ValueError(f"{where}: adapter_config.json needs a positive {key!r}")
    return cfg


__all__ = [
    "LORA_LOAD_TIMEOUT_S",
    "LoRAModulePath",
    "LoRARequest",
    "SUPPORTED_TARGETS",
    "adapter_digest",
    "read_adapter_config",
]
