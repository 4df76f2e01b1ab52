"""The cluster's KV owner actor (detached, named): it holds Ray exports under their leases and
is the directory of the point-to-point servers.

    producer                       owner actor                        consumer
    ray.put -> hold(tid, [ref])    keeps the ref (Ray counts it)      wait_lookup(tid) -> [ref]
                                   until release() by every reader    release(tid, rank, readers)
                                   or the lease ends
    register("p2p/<engine>/r<rank>", host:port)                       resolve(name) -> host:port

Whoever asks first creates it (`get_owner`); it outlives the engines that use it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, TypedDict

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

# What a Ray export is: a batch's header and its bytes (kv_transfer.blocks), one object.
Export = tuple[bytes, npt.NDArray[np.uint8]]


class _Held(NamedTuple):
    refs: list[ObjectRef[Export]]  # the producer's object, inside a list so that it stays a ref
    expiry: float  # time.time()
    nbytes: int


class OwnerStats(TypedDict):
    held: int  # exports held now
    bytes: int  # ... their bytes
    expired: int  # exports whose lease ended unclaimed
    waits: int  # wait_lookup calls that found nothing yet and waited
    woken: int  # ... of which a hold answered


class KVObjectOwner:
    """Owns exported KV objects and drops each when its consumer confirms or its lease ends.

    An async actor: a consumer that asks for an export before it has landed (`wait_lookup`)
    is answered the moment the producer's `hold` arrives, instead of asking again every few
    ms (each ask an actor call on this one actor the whole cluster shares). The other
    methods are quick and run on the actor's event loop; `adopt`'s copy runs beside it."""

    def __init__(self, sweep_s: float = 0.5) -> None:
        self._held: dict[str, _Held] = {}  # by transfer id
        self._readers: dict[str, set[int]] = {}  # tid -> consumer ranks that confirmed
        self._names: dict[str, str] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}  # tid -> consumers waiting for it
        self._lock = threading.Lock()
        self.num_expired = 0
        self.num_waits = 0  # wait_lookup calls that found nothing yet and waited
        self.num_woken = 0  # ... of which a hold answered
        threading.Thread(target=self._sweep_loop, args=(sweep_s,), daemon=True).start()

    def hold(self, transfer_id: str, refs: list[ObjectRef[Export]], nbytes: int, lease_s: float) -> None:
        """Borrow the producer's object (passed inside a list, so it stays a ref) until the
        consumer confirms or the lease ends."""
        with self._lock:
            self._held[transfer_id] = _Held(refs, time.time() + lease_s, nbytes)
        for fut in self._waiters.pop(transfer_id, ()):  # on the event loop: no lock needed
            if not fut.done():
                fut.set_result(None)

    async def adopt(self, transfer_id: str, header: bytes, payload: npt.NDArray[np.uint8], lease_s: float) -> None:
        """Take a copy of the blocks into an object this actor owns, so the export outlives
        its producer (Ray >= 2.56 has no `ray.put(_owner=...)`: only the putting process
        can own an object). The copy runs off the event loop."""
        import ray

        ref: ObjectRef[Export] = await asyncio.get_running_loop().run_in_executor(None, ray.put, (header, payload))
        self.hold(transfer_id, [ref], len(payload), lease_s)

    def lookup(self, transfer_id: str) -> Optional[list[ObjectRef[Export]]]:
        with self._lock:
            entry = self._held.get(transfer_id)
        return None if entry is None else entry.refs

    async def wait_lookup(self, transfer_id: str, timeout_s: float) -> Optional[list[ObjectRef[Export]]]:
        """`lookup`, waiting up to `timeout_s` for the export to be held if it is not yet."""
        refs = self.lookup(transfer_id)
        if refs is not None or timeout_s <= 0:
            return refs
        self.num_waits += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(transfer_id, []).append(fut)
        try:
            done, _ = await asyncio.wait({fut}, timeout=timeout_s)  # (a timeout: not held yet)
            self.num_woken += len(done)
        finally:
            waiting = self._waiters.get(transfer_id)
            if waiting is not None and fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiters[transfer_id]
        return self.lookup(transfer_id)

    def release(self, transfer_id: str, reader: int = 0, num_readers: int = 1) -> bool:
        """Reader `reader` is done; the object goes once all `num_readers` consumer ranks
        that read it said so (with TP each consumer rank takes its own heads from it)."""
        with self._lock:
            done = self._readers.setdefault(transfer_id, set())
            done.add(reader)
            if len(done) < num_readers:
                return False
            del self._readers[transfer_id]
            return self._held.pop(transfer_id, None) is not None

    # A directory too: where each engine rank's point-to-point server listens (connectors.p2p).
    def register(self, name: str, value: str) -> None:
        with self._lock:
            self._names[name] = value

    def resolve(self, name: str) -> Optional[str]:
        with self._lock:
            return self._names.get(name)

    def stats(self) -> OwnerStats:
        with self._lock:
            return OwnerStats(
                held=len(self._held),
                bytes=sum(e.nbytes for e in self._held.values()),
                expired=self.num_expired,
                waits=self.num_waits,
                woken=self.num_woken,
            )

    def _sweep_loop(self, sweep_s: float) -> None:
        while True:
            time.sleep(sweep_s)
            now = time.time()
            with self._lock:
                for tid in [t for t, e in self._held.items() if e.expiry < now]:
                    del self._held[tid]
                    self._readers.pop(tid, None)
                    self.num_expired += 1


def connect_ray(extra: dict[str, Any]) -> ModuleType:
    """The `ray` module, connected to the cluster (`ray_address`, else RAY_ADDRESS) unless this
    process is already."""
    import ray

    if not ray.is_initialized():
        address = extra.get("ray_address") or os.environ.get("RAY_ADDRESS")
        if not address:
            raise ValueError(
                "RayObjectStoreConnector: this process is not connected to Ray; set "
                "kv_connector_extra_config.ray_address or RAY_ADDRESS"
            )
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    return ray


def get_owner(ray: ModuleType, name: str, namespace: str) -> ActorHandle[KVObjectOwner]:
    """The cluster's owner actor, created by whoever asks first (detached: it outlives us)."""
    cls = ray.remote(KVObjectOwner)
    handle: ActorHandle[KVObjectOwner] = cls.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=1000
    ).remote()
    return handle
