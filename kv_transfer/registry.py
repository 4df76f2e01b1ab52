"""Connector names, without importing torch: the engines resolve them in
`kv_transfer.factory`; configs and the CLI check them here first."""

from __future__ import annotations

from typing import Any

from fleetserve.scheduler.policies import resolve_obj_by_qualname

REGISTRY: dict[str, str] = {
    "SharedStorageConnector": "fleetserve.kv_transfer.connectors.shared_storage:SharedStorageConnector",
    "RayObjectStoreConnector": "fleetserve.kv_transfer.connectors.ray_store:RayObjectStoreConnector",
    "P2PConnector": "fleetserve.kv_transfer.connectors.p2p:P2PConnector",
    "FaultInjectionConnector": "fleetserve.kv_transfer.connectors.faults:FaultInjectionConnector",
}

# Short names (`--kv-connector`, the app config's `pd.connector`) -> registered names.
ALIASES: dict[str, str] = {
    "ray_object_store": "RayObjectStoreConnector",
    "shared_storage": "SharedStorageConnector",
    "p2p": "P2PConnector",
}


def canonical_connector_name(name: str) -> str:
    """A short name's registered name; other names unchanged."""
    return ALIASES.get(name, name)


def connector_qualname(name: str) -> str:
    """The "package.module:Class" the engines import for `name` (registered, short or already
    qualified), or ValueError naming the choices."""
    name = canonical_connector_name(name)
    qualname = REGISTRY.get(name, name)
    if ":" not in qualname and "." not in qualname:
        raise ValueError(
            f"unknown KV connector {name!r}: use one of {sorted(ALIASES)}, {sorted(REGISTRY)} or 'package.module:Class'"
        )
    return qualname


# The class every connector derives from, named as the connectors are: a class is checked
# against it by the names in its MRO, so this module imports no connector code (kv_transfer.base
# imports the config, which imports this module; the factory checks with issubclass).
CONNECTOR_BASE = "fleetserve.kv_transfer.base:KVConnectorBase"


def is_connector_class(obj: object) -> bool:
    """Whether `obj` is a class deriving from KVConnectorBase (CONNECTOR_BASE)."""
    return isinstance(obj, type) and any(f"{k.__module__}:{k.__qualname__}" == CONNECTOR_BASE for k in obj.__mro__)


def check_connector_name(name: str) -> str:
    """`name` as the engines will resolve it, or ValueError naming the choices. Registered and
    short names are checked without importing anything (no torch in a CLI or config check);
    a "package.module:Class" name is imported, as the engines will, and must be a connector."""
    name = canonical_connector_name(name)
    if name in REGISTRY:
        return name
    cls = resolve_obj_by_qualname(connector_qualname(name), what="KV connector")
    if not is_connector_class(cls):
        raise ValueError(f"KV connector {name!r} is not a KVConnectorBase subclass")
    return name


# What each registered connector reads from `kv_connector_extra_config`: (required keys,
# {key: type}). Checked where a config is parsed, so a missing folder or a mistyped option
# is a clear error before Ray starts, not a stack trace from every engine replica's start-up
# (which Serve retries for every replica before it gives up). Keys not listed are passed on
# as vLLM does; custom 'module:Class' connectors check their own options.
_COMMON = {"staging_max_bytes": int, "layerwise_save": bool, "model_id": str}
_RAY = {"ray_address": str, "owner_name": str, "namespace": str, "durable_owner": bool}
OPTIONS: dict[str, tuple[frozenset[str], dict[str, type]]] = {
    "SharedStorageConnector": (frozenset({"path"}), {"path": str, "max_bytes": int, "fsync": bool, "digest": str}),
    "RayObjectStoreConnector": (frozenset(), _RAY),
    "P2PConnector": (
        frozenset(),
        {**_RAY, "host": str, "p2p_max_groups": int, "p2p_server_threads": int, "stream_chunk_bytes": int},
    ),
    "FaultInjectionConnector": (frozenset({"inner"}), {"inner": str, "inner_extra": dict, "faults": dict, "seed": int}),
}
_KINDS = {str: "a string", int: "an integer", bool: "true or false", dict: "a JSON object"}
_AT_LEAST = {
    "max_bytes": 1,
    "p2p_max_groups": 1,
    "p2p_server_threads": 1,
    "staging_max_bytes": 0,
    "stream_chunk_bytes": 1,
}
_EXAMPLES = {
    "path": '{"path": "/mnt/kv"}',
    "inner": '{"inner": "SharedStorageConnector", "inner_extra": {"path": "/tmp/kv"}}',
}


def check_connector_options(name: str, extra: dict[str, Any], where: str = "") -> None:
    """ValueError if a registered connector `name` cannot start with `extra` (a required key
    missing or empty, a known key of the wrong type); nothing imported. `where` (the config
    section and flag the options came from) is added to the message."""
    try:
        _check_options(name, extra)
    except ValueError as e:
        raise ValueError(f"{e} ({where})" if where else str(e)) from None


def _check_options(name: str, extra: object) -> None:
    name = canonical_connector_name(name)
    if name not in OPTIONS:
        return
    if not isinstance(extra, dict):
        raise ValueError(f"kv_connector_extra_config must be a JSON object, not {extra!r}")
    required, types = OPTIONS[name]
    for key in sorted(required):
        value = extra.get(key)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"{name} needs kv_connector_extra_config.{key}, e.g. {_EXAMPLES.get(key, key)}")
    for key, want in {**_COMMON, **types}.items():
        if key not in extra:
            continue
        value = extra[key]
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            raise ValueError(f"kv_connector_extra_config.{key} of {name} must be {_KINDS[want]}, not {value!r}")
        if key in _AT_LEAST and value < _AT_LEAST[key]:
            raise ValueError(f"kv_connector_extra_config.{key} must be >= {_AT_LEAST[key]}, not {value}")
    if name == "SharedStorageConnector" and extra.get("digest", "unkeyed") not in ("unkeyed", "keyed"):
        raise ValueError(
            f'kv_connector_extra_config.digest of {name} must be "unkeyed" or "keyed", not {extra["digest"]!r}'
        )
    if name == "FaultInjectionConnector":
        _check_options(check_connector_name(extra["inner"]), extra.get("inner_extra") or {})
