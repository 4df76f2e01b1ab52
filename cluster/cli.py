"""The `fleetserve` command line.

    fleetserve serve [--model M] [--num-replicas 2] [--routing-policy prefix_aware] ...
    fleetserve serve --config app.yaml [--port 8080]      # flags override the file
    fleetserve chat [--url http://127.0.0.1:8000/v1]       # talk to a running server
    fleetserve profile --num-replicas 2 -o p.json        # measure a replica's step costs
    fleetserve sim --trace T.jsonl --profile P --num-replicas 8   # a simulated fleet

Each subcommand is one `add_<name>_parser(subparsers)` + `cmd_<name>(args)` pair
registered in `SUBCOMMANDS`; adding one is adding a pair.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable, Optional

from pydantic import ValidationError

from fleetserve.cluster.build import add_build_parser
from fleetserve.cluster.cli_engine import (
    add_engine_flags,
    add_schema_flags,
    engine_kwargs,
    nested_overrides,
    schema_fields,
)
from fleetserve.cluster.client import add_chat_parser, add_complete_parser
from fleetserve.cluster.generate import add_generate_parser
from fleetserve.cluster.profile_cmd import add_profile_parser
from fleetserve.cluster.sim_cmd import add_sim_parser

log = logging.getLogger("fleetserve")


def add_serve_parser(sub) -> None:
    from fleetserve.cluster.config import AppConfig

    p = sub.add_parser(
        "serve",
        help="serve a model over OpenAI HTTP and gRPC from a Ray cluster",
        description="Serve a model over OpenAI HTTP and gRPC from a Ray cluster. "
        "Every flag below is a field of the application config "
        "(cluster/config.py); --config reads the same fields from YAML.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("model_tag", nargs="?", help="the model (same as --model)")
    p.add_argument(
        "--config", help="application YAML (cluster/config.py's schema); flags given here override it [default: unset]"
    )
    add_engine_flags(p)
    add_schema_flags(p.add_argument_group("application"), AppConfig, skip=APP_SKIP)
    p.set_defaults(func=cmd_serve)


# AppConfig fields that are not flags of their own: `engine` has the engine group.
APP_SKIP = ("engine",)


def config_from_args(args: argparse.Namespace):
    """Build the AppConfig: YAML file (if any), then flags on top."""
    from fleetserve.cluster.config import AppConfig

    engine = engine_kwargs(args)
    overrides: dict[str, Any] = {"engine": engine} if engine else {}
    dests = [path for path, _, _ in schema_fields(AppConfig, skip=APP_SKIP)]
    overrides.update(nested_overrides(args, dests))
    config_file = vars(args).get("config")
    if config_file:
        return AppConfig.from_yaml(config_file, **overrides)
    return AppConfig.model_validate(overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from fleetserve.replica.model_loader.registry import ModelNotFoundError

    try:
        config = config_from_args(args)
    except (ValidationError, ValueError, OSError) as e:
        print(f"fleetserve serve: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    from fleetserve.cluster.topology import check_kv_memory, check_model, check_ports

    try:
        check_ports(config)
        check_model(config)  # metadata only, before Ray starts
        check_kv_memory(config)
    except (ModelNotFoundError, ValueError) as e:
        print(f"fleetserve serve: {e}", file=sys.stderr)
        return 2
    from fleetserve.cluster.lifecycle import run_server

    return run_server(config)


SUBCOMMANDS: list[Callable] = [
    add_serve_parser,
    add_generate_parser,
    add_build_parser,
    add_chat_parser,
    add_complete_parser,
    add_profile_parser,
    add_sim_parser,
]


def build_parser() -> argparse.ArgumentParser:
    from fleetserve import __version__

    parser = argparse.ArgumentParser(prog="fleetserve", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"fleetserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
