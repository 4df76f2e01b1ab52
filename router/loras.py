"""The LoRA adapters the ingress serves by name, and their administration at run time.

A request names an adapter in `model`. The ingress is the app's registry of those names
(the engine replicas only cache weights): each engine body for an adapter carries its name,
its path (a replica that lacks it, started after a run-time load or having evicted it under
--max-cpu-loras, loads it from there first) and its key (`name@digest`, the engines' own,
which prefix routing salts the prompt's block hashes with).

Adapters come from --lora-modules (`LoRASettings.adapters`) and, with
--allow-runtime-lora-updating, from vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
(`load`, `unload`: on every engine replica, one admin operation at a time). Those loaded at
run time are also kept in Ray's GCS (router/runtime_loras.py), so an ingress that Serve
restarts after a crash serves them again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from fleetserve.router.api.errors import APIError
from fleetserve.router.runtime_loras import RuntimeLoRAs
from fleetserve.router.settings import LoRASettings

logger = logging.getLogger("ray.serve")

# The ingress's `replica_calls(op, timeout_s=..., **kwargs)`: op on every engine replica.
ReplicaCalls = Callable[..., Awaitable[dict[str, dict]]]


class LoRAAdmin:
    """name -> path of the adapters served, their keys and parents. `reserved`: the base
    model's names, which no adapter may take."""

    def __init__(self, settings: LoRASettings, reserved: frozenset[str]) -> None:
        self._paths = dict(settings.adapters)
        self._parents = dict(settings.parents)  # --lora-modules' base_model_name, where given
        self._keys: dict[str, str] = {}
        self._reserved = reserved
        self._allow_updates = settings.allow_runtime_updating
        self._load_timeout_s = settings.load_timeout_s
        self._lock = asyncio.Lock()
        self._runtime: dict[str, dict] = {}  # those loaded at run time: name -> {"path", "key"}
        self._registry = (
            RuntimeLoRAs(settings.app_name, settings.instance_id)
            if settings.allow_runtime_updating and settings.app_name and settings.instance_id
            else None
        )
        if self._registry is not None:
            self._restore(self._registry)

    def _restore(self, registry: RuntimeLoRAs) -> None:
        for name, entry in registry.restore().items():
            if name in self._reserved or name in self._paths:
                continue  # a name the (same) config gives otherwise
            self._paths[name] = entry["path"]
            if entry.get("key"):
                self._keys[name] = entry["key"]
            self._runtime[name] = entry
        if self._runtime:
            logger.info(
                "ingress restarted: LoRA adapters loaded at run time before, served again: %s",
                ", ".join(sorted(self._runtime)),
            )

    # -- what requests ask ---------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def names(self) -> list[str]:
        """The adapters' names, in the order they were added (/v1/models lists them so)."""
        return list(self._paths)

    def learn_keys(self, info: dict) -> None:
        """The keys the engines computed for the configured adapters (their first info)."""
        for name, key in (info.get("lora_keys") or {}).items():
            self._keys.setdefault(name, key)

    def body_fields(self, model: Optional[str]) -> dict:
        """What an engine body for `model` carries when it names an adapter ({} otherwise)."""
        if model not in self._paths:
            return {}
        fields = {"lora_name": model}
        if model in self._keys:  # what the routers salt prefix hashes with, as the engine
            fields["lora_key"] = self._keys[model]
        fields["lora_path"] = self._paths[model]
        return fields

    def card(self, name: str, base_model: str, created: int, max_model_len: int) -> dict:
        """vLLM's /v1/models card of an adapter: its path, and the base model as its parent."""
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "fleetserve",
            "root": self._paths[name],
            "parent": self._parents.get(name, base_model),
            "max_model_len": max_model_len,
        }

    # -- administration at run time ------------------------------------------------

    def _check_updates(self) -> None:
        if not self._allow_updates:
            raise APIError(
                "loading and unloading LoRA adapters at run time is off; start the server "
                "with --enable-lora --allow-runtime-lora-updating",
                404,
            )

    async def load(self, name: str, path: str, replica_calls: ReplicaCalls) -> int:
        """Load an adapter on every engine replica (both pools with P/D); a replica that
        starts later loads it with the first request for it. The replicas that took it; an
        APIError after unloading it from those that had taken it, when any replica cannot load
        it: 404 "not found or cannot be loaded" for a path a replica refuses or cannot read
        (outside --lora-roots, missing, unreadable: the same words, the reason in the replica's
        log), 429 when a replica is busy, 400 naming what else is wrong."""
        self._check_updates()
        async with self._lock:
            if name in self._reserved or name in self._paths:
                what = "LoRA adapter" if name in self._paths else "model name"
                raise APIError(
                    f"The {what} '{name}' is already in use; unload it first or pick another name",
                    400,
                    param="lora_name",
                )
            # replace: a replica's copy under a name this ingress does not serve is left over
            # (from an ingress of an earlier config, which forgot it): the new weights win.
            results = await replica_calls(
                "load_lora", timeout_s=self._load_timeout_s + 15, name=name, path=path, replace=True
            )
            if not results:
                raise APIError("no engine replica is running to load the adapter on", 503)
            failed = [r for r in results.values() if "error" in r]
            if failed:
                await replica_calls("unload_lora", name=name)
                busy = [r for r in failed if r.get("status") == 429]
                missing = [r for r in failed if r.get("status") == 404]
                if missing and not busy:
                    raise APIError(missing[0]["error"], 404, param="lora_path", code="model_not_found")
                raise APIError(
                    f"LoRA adapter '{name}' could not be loaded: {(busy or failed)[0]['error']}",
                    429 if busy else 400,
                    param="lora_path",
                )
            keys = {r["key"] for r in results.values()}
            if len(keys) > 1:
                logger.warning("LoRA adapter %r: the replicas read different files at %s (%s)", name, path, keys)
            self._paths[name] = path
            self._keys[name] = min(keys)
            self._runtime[name] = {"path": path, "key": min(keys)}
            await self._save()
        logger.info("LoRA adapter %r loaded from %s on %d replicas", name, path, len(results))
        return len(results)

    async def unload(self, name: str, replica_calls: ReplicaCalls) -> None:
        """Stop serving an adapter: new requests naming it get a 404 at once; requests running
        with it finish with it, then each replica frees its weights."""
        self._check_updates()
        async with self._lock:
            if name not in self._paths:
                raise APIError(
                    f"The LoRA adapter '{name}' cannot be found.", 404, param="lora_name", code="model_not_found"
                )
            del self._paths[name]
            self._parents.pop(name, None)
            self._keys.pop(name, None)
            if self._runtime.pop(name, None) is not None:
                await self._save()
            await replica_calls("unload_lora", name=name)

    async def _save(self) -> None:
        if self._registry is not None:  # (under the admin lock: saves land in order)
            await asyncio.to_thread(self._registry.save, dict(self._runtime))

    def close(self) -> None:
        """The ingress stops for good (Serve's graceful stop): the adapters loaded at run
        time go with it. A crash runs no close, and the ingress Serve starts in its place
        takes them back."""
        if self._registry is not None and self._runtime:
            self._registry.drop()
