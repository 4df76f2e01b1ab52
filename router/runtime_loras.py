"""The LoRA adapters loaded at run time (/v1/load_lora_adapter), kept where a restarted ingress
finds them again.

The ingress is the app's registry of adapter names: the engine replicas only cache weights (a
replica that lacks an adapter loads it from the path the ingress sends). Kept in the ingress's
memory alone, as `vllm serve` keeps them, a crash of the ingress replica (Serve starts a new
one with the same arguments) would forget every adapter loaded at run time: /v1/models would
drop them and requests naming them would get a 404 while the replicas still hold their
weights. So the list also goes to Ray's GCS key-value store (where Ray Serve keeps its own
state), one entry per app, tagged with a hash of the app's config: an ingress restarted after
a crash (the same config) takes the list back. An ingress that stops gracefully (the app
deleted or redeployed with another config, `fleetserve serve` stopped) drops the list, and one
of another config never reads it: a new app starts without them, as a restarted `vllm serve`
does.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

logger = logging.getLogger(__name__)

NAMESPACE = "fleetserve"


class RuntimeLoRAs:
    """name -> {"path": ..., "key": ...} of the adapters this app loaded at run time, in the GCS."""

    def __init__(self, app_name: str, instance_id: str) -> None:
        self.key = f"runtime_loras/{app_name}"
        self.instance_id = instance_id

    @staticmethod
    def _kv():
        # (Ray core's, not Serve's: Ray 2.60 has no public API to its GCS key-value store;
        # this is the module Serve keeps its own state through.)
        from ray.experimental import internal_kv

        return internal_kv if internal_kv._internal_kv_initialized() else None

    def restore(self) -> dict[str, dict]:
        """What an earlier ingress of this deployment saved ({} for a new deployment, or
        where the store cannot be read: then, as before, the list starts empty)."""
        try:
            kv = self._kv()
            raw = kv._internal_kv_get(self.key, namespace=NAMESPACE) if kv is not None else None
            data = json.loads(raw) if raw else {}
        except Exception as e:  # noqa: BLE001 - a registry that cannot be read is an empty one
            logger.warning(
                "runtime LoRA adapters: could not read %s from Ray's GCS (%r); starting with none", self.key, e
            )
            return {}
        if not isinstance(data, dict) or data.get("instance") != self.instance_id:
            return {}
        adapters = data.get("adapters")
        return (
            {
                name: dict(entry)
                for name, entry in adapters.items()
                if isinstance(entry, dict) and isinstance(entry.get("path"), str)
            }
            if isinstance(adapters, dict)
            else {}
        )

    def drop(self) -> None:
        """Forget the list, if it is this deployment's (an ingress stopping for good; the one
        replacing it in a rolling update may have saved its own already)."""
        try:
            kv = self._kv()
            if kv is None:
                return
            raw = kv._internal_kv_get(self.key, namespace=NAMESPACE)
            if raw and json.loads(raw).get("instance") == self.instance_id:
                kv._internal_kv_del(self.key, namespace=NAMESPACE)
        except Exception as e:  # noqa: BLE001 - at shutdown: nothing to do about it
            logger.info("runtime LoRA adapters: could not drop %s from Ray's GCS (%r)", self.key, e)

    def save(self, adapters: dict[str, dict]) -> Optional[str]:
        """Write the whole list (the caller holds its admin lock); the error's text, else None."""
        try:
            kv = self._kv()
            if kv is None:
                return "Ray is not initialized in this process"
            kv._internal_kv_put(
                self.key,
                json.dumps({"instance": self.instance_id, "adapters": adapters}),
                overwrite=True,
                namespace=NAMESPACE,
            )
        except Exception as e:  # noqa: BLE001 - the adapter is loaded all the same
            logger.warning(
                "runtime LoRA adapters: could not save the list to Ray's GCS (%r): a "
                "restarted ingress will not know them",
                e,
            )
            return repr(e)
        return None


__all__ = ["NAMESPACE", "RuntimeLoRAs"]
