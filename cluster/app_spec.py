"""An app config as Serve's deploy config carries it (`args`): strict validation, the
API key it resolves to, the keys written back, and the deploy config itself.

    serve_deploy_config(config) -> {"http_options": ..., "grpc_options": ...,
                                    "applications": [{"name", "route_prefix", "import_path", "args"}]}

Shared by the app builder (`serve_app`, which Serve imports on the cluster), the deployer
(`deploy`, which the builder calls) and `fleetserve build`: kept apart so that neither of
the first two imports the other, and so that `build` needs no Ray.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from pydantic import ValidationError

from fleetserve.cluster.config import AppConfig

# What a deploy config's application imports on the cluster (cluster/serve_app.py).
APP_BUILDER = "fleetserve.cluster.serve_app:app_builder"
# Our own registration: undecodable messages become INVALID_ARGUMENT (router.grpc.service).
GRPC_SERVICER = "fleetserve.router.grpc.service.add_servicer"
# Keys of AppConfig that only the `fleetserve serve` process uses (which Ray to join).
PROCESS_ONLY_KEYS = ("address",)


class AppConfigError(ValueError):
    """An app config that does not validate; the message names every bad field."""


def describe(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def validate_args(args: Any, process_keys: bool = False) -> AppConfig:
    """`args` as an AppConfig, strictly. `process_keys`: also accept the keys only a
    `fleetserve serve` process uses (a user's app.yaml, read by `fleetserve build`)."""
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise AppConfigError(f"the app config must be a mapping, got {type(args).__name__}")
    try:
        config = AppConfig.model_validate(args)
    except ValidationError as e:
        raise AppConfigError(f"invalid fleetserve app config:\n{describe(e)}") from None
    if config.address and not process_keys:
        raise AppConfigError(
            "address: not used by a Serve deploy config (the cluster that "
            "runs `serve deploy` is the one it deploys to); remove it"
        )
    return config


def resolve_api_key(config: AppConfig) -> Optional[str]:
    """`api_key`, or the value of the environment variable `api_key_env` names, or the
    contents of `api_key_file`, or $FLEETSERVE_API_KEY (router/auth.py)."""
    if config.api_key is not None or config.api_key_env is None:
        from fleetserve.router.auth import resolve_api_key as from_file_or_env

        return from_file_or_env(config.api_key, config.api_key_file)
    value = os.environ.get(config.api_key_env)
    if not value:
        raise AppConfigError(
            f"api_key_env: the environment variable {config.api_key_env!r} is not set (or empty) where the app is built"
        )
    return value


def app_args(config: AppConfig) -> dict:
    """The app config as written by the user (keys they set), minus process-only keys."""
    data = config.model_dump(mode="json", exclude_unset=True)
    for key in PROCESS_ONLY_KEYS:
        data.pop(key, None)
    return data


def serve_deploy_config(config: AppConfig) -> dict:
    """A document that `ray.serve.schema.ServeDeploySchema` accepts."""
    out: dict[str, Any] = {
        "proxy_location": "EveryNode",
        "http_options": {"host": config.http.host, "port": config.http.port},
    }
    if config.grpc.enabled:
        out["grpc_options"] = {"port": config.grpc.port, "grpc_servicer_functions": [GRPC_SERVICER]}
    out["logging_config"] = {"enable_access_log": False}
    out["applications"] = [
        {"name": config.name, "route_prefix": "/", "import_path": APP_BUILDER, "args": app_args(config)}
    ]
    return out
