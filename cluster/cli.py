"""The `fleetserve` command line.

    fleetserve serve [--model M] [--num-replicas 2] [--routing-policy prefix_aware] ...
    fleetserve serve --config app.yaml [--port 8080]      # flags override the file

Each subcommand is one `add_<name>_parser(subparsers)` + `cmd_<name>(args)` pair
registered in `SUBCOMMANDS`; adding one is adding a pair.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any, Callable, Optional

from pydantic import ValidationError

from fleetserve.cluster.cli_engine import add_engine_flags, engine_kwargs
from fleetserve.cluster.generate import add_generate_parser

log = logging.getLogger("fleetserve")

def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI HTTP and gRPC from a Ray cluster",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       argument_default=argparse.SUPPRESS)
    p.add_argument("model_tag", nargs="?", help="the model (same as --model)")
    p.add_argument("--config", help="application YAML; flags given here override it")
    add_engine_flags(p)
    app = p.add_argument_group("application")
    app.add_argument("--num-replicas", type=int, help="engine replicas (default 2)")
    app.add_argument("--routing-policy", choices=["power_of_two", "least_loaded", "prefix_aware"])
    app.add_argument("--api-key", help="require 'Authorization: Bearer <key>' (visible in ps: "
                     "prefer --api-key-file or $FLEETSERVE_API_KEY)")
    app.add_argument("--api-key-file", help="a file holding the API key")
    app.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    app.add_argument("--port", type=int, help="HTTP port (default 8000)")
    app.add_argument("--grpc-port", type=int, help="gRPC port (default 9000)")
    app.add_argument("--no-grpc", action="store_true", help="do not start the gRPC proxy")
    app.add_argument("--address", help="Ray address: 'auto' or host:port joins a cluster "
                                       "(default: an embedded local Ray)")
    app.add_argument("--num-cpus-per-replica", type=float)
    p.set_defaults(func=cmd_serve)


def config_from_args(args: argparse.Namespace):
    """Build the AppConfig: YAML file (if any), then flags on top."""
    from fleetserve.cluster.config import AppConfig

    given = vars(args)
    engine = engine_kwargs(args)
    overrides: dict[str, Any] = {"engine": engine} if engine else {}
    for flag, field in (("num_replicas", "num_replicas"), ("routing_policy", "routing_policy"),
                        ("api_key", "api_key"), ("api_key_file", "api_key_file"),
                        ("address", "address"),
                        ("num_cpus_per_replica", "num_cpus_per_replica")):
        if flag in given:
            overrides[field] = given[flag]
    http = {k: given[k] for k in ("host", "port") if k in given}
    if http:
        overrides["http"] = http
    grpc: dict[str, Any] = {}
    if "grpc_port" in given:
        grpc["port"] = given["grpc_port"]
    if given.get("no_grpc"):
        grpc["enabled"] = False
    if grpc:
        overrides["grpc"] = grpc
    if given.get("config"):
        return AppConfig.from_yaml(given["config"], **overrides)
    return AppConfig.model_validate(overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValidationError, ValueError, OSError) as e:
        print(f"fleetserve serve: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    from ray import serve

    from fleetserve.cluster.deploy import connect_ray, delete_and_drain, deploy, endpoints, start_serve

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info("starting Ray (%s)", config.address or "embedded, local")
    connect_ray(config)
    # ray.init installs its own SIGTERM handler (sys.exit): put ours back, so SIGTERM drains
    # (delete_and_drain below) like Ctrl-C instead of exiting with the streams in flight.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        start_serve(config)
        deploy(config)
        for line in endpoints(config):
            log.info("%s", line)
        log.info("ready; Ctrl-C to stop")
        stop.wait()
        log.info("shutting down")
    finally:
        delete_and_drain(config)  # in-flight requests finish (reliability.graceful_shutdown_timeout_s)
        if not config.address:
            serve.shutdown()
        import ray
        ray.shutdown()
    return 0


SUBCOMMANDS: list[Callable] = [add_serve_parser, add_generate_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetserve", description=__doc__.split("\n")[0])
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
