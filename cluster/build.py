"""`fleetserve build`: the app config as a Ray Serve deploy config.

    fleetserve build app.yaml -o serve.yaml
    serve deploy serve.yaml              # on a running Ray cluster (after `ray up`)

The written file names fleetserve's app builder (`cluster/serve_app.py`) with the app
config as its `args`, so `serve deploy` serves what `fleetserve serve --address auto
--config app.yaml` serves. The config is validated here first: a bad value fails
before anything is written, naming the field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HEADER = (
    "# Ray Serve deploy config written by `fleetserve build` from {src}.\n"
    "# Deploy it on a running Ray cluster with fleetserve installed: serve deploy {dst}\n"
    "# Edit the app config and rebuild rather than editing `args` here.\n"
)


def add_build_parser(sub) -> None:
    p = sub.add_parser("build", help="write a Ray Serve deploy config (serve deploy FILE) from an application YAML")
    p.add_argument("config", help="application YAML (the same file `fleetserve serve --config` takes)")
    p.add_argument("-o", "--output", default="-", help="where to write it ('-': stdout)")
    p.set_defaults(func=cmd_build)


def build_document(config_path: str) -> dict:
    """Read and validate the app config; return the Serve deploy config. Raises
    AppConfigError (field named), or OSError / yaml.YAMLError for the file itself."""
    from fleetserve.cluster.app_spec import serve_deploy_config, validate_args

    data = yaml.safe_load(Path(config_path).read_text())
    return serve_deploy_config(validate_args(data, process_keys=True))


def cmd_build(args: argparse.Namespace) -> int:
    from fleetserve.cluster.app_spec import AppConfigError

    try:
        doc = build_document(args.config)
    except (AppConfigError, OSError, yaml.YAMLError) as e:
        print(f"fleetserve build: {args.config}: {e}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(doc, sort_keys=False)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    Path(args.output).write_text(HEADER.format(src=args.config, dst=args.output) + text)
    print(f"wrote {args.output}: serve deploy {args.output}", file=sys.stderr)
    return 0
