"""Connector names, without importing torch: the engines resolve them in
`kv_transfer.factory`; configs and the CLI check them here first."""

from __future__ import annotations

REGISTRY: dict[str, str] = {
    "SharedStorageConnector": "fleetserve.kv_transfer.shared_storage:SharedStorageConnector",
    "RayObjectStoreConnector": "fleetserve.kv_transfer.ray_store:RayObjectStoreConnector",
    "P2PConnector": "fleetserve.kv_transfer.p2p:P2PConnector",
    "FaultInjectionConnector": "fleetserve.kv_transfer.faults:FaultInjectionConnector",
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


def check_connector_name(name: str) -> str:
    """`name` as the engines will resolve it, or ValueError naming the choices. Registered and
    short names are checked without importing anything (no torch in a CLI or config check);
    a "package.module:Class" name is imported, as the engines will."""
    name = canonical_connector_name(name)
    if name in REGISTRY:
        return name
    if ":" not in name and "." not in name:
        raise ValueError(f"unknown KV connector {name!r}: use one of {sorted(ALIASES)}, "
                         f"{sorted(REGISTRY)} or 'package.module:Class'")
    from fleetserve.kv_transfer.factory import resolve_connector_class  # imports torch

    resolve_connector_class(name)
    return name
