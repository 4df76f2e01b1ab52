"""The adapters an AsyncEngine holds at run time: loads, unloads and evictions by name.

A load (vLLM's /v1/load_lora_adapter on one engine, or a request that names an adapter this
replica lacks, with the path the ingress sends: a lazy load on first use) runs as:

1. the path checks (lora.paths: --lora-roots, regular files) and the digest of the files,
   on a thread of this process, within --lora-load-timeout;
2. the engine core's AddLoRA: read and converted off the step loop, installed between
   steps (lora.loader), answered within what is left of the deadline (plus a margin for
   a busy core).

Every path refusal is the same `LoRANotLoadable` (HTTP 404), the reason in the log.

An unload (`remove`) wins over anything already in flight for that name: a load under way
(explicit or lazy) is discarded when it ends, and the name is marked unloaded, so a request
built before the unload (it still carries the adapter's path) cannot load it back: it fails
with `LoRANotLoadable`. Requests already in the engine finish with the adapter they
started with (the core keeps its weights until they end). Only an explicit load (`add`,
`lazy=False`: the admin's) serves the name again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Optional

from fleetserve.replica.engine.errors import LoRACapacityError
from fleetserve.replica.lora.paths import LoRAFileError, LoRANotLoadable, LoRAPathPolicy, is_not_loadable
from fleetserve.replica.lora.request import adapter_digest, read_adapter_config

if TYPE_CHECKING:
    from fleetserve.replica.engine.core_client import EngineCoreClient
    from fleetserve.replica.engine.engine_args import EngineArgs
    from fleetserve.replica.engine.processor import InputProcessor

logger = logging.getLogger(__name__)

# How long past its own deadline a load waits for the core's answer (a step in progress).
ANSWER_MARGIN_S = 10.0
# Names unloaded that a lazy load may not bring back (oldest forgotten first past this).
MAX_UNLOADED_NAMES = 4096


def timeout_text(name: str, timeout_s: float) -> str:
    return f"loading LoRA adapter '{name}' took over {timeout_s:g} s (--lora-load-timeout); gave up"


class EngineLoRAs:
    """name -> (engine id, key) lives in the input processor's `loras` (what requests may
    name); this keeps the rest: loads in flight, use counts, unloaded names."""

    def __init__(self, args: EngineArgs, client: EngineCoreClient, input_processor: InputProcessor) -> None:
        self.args = args
        self._client = client
        self._loras = input_processor.loras
        self.policy = LoRAPathPolicy.from_args(args)
        # Adapters loaded at run time take ids after --lora-modules' (one load per name at once).
        self._next_id = len(args.lora_modules or ()) + 1
        self._loading: dict[str, asyncio.Future] = {}
        self._core_loading: dict[str, int] = {}  # name -> the id its core load in flight has
        self._admin = asyncio.Lock()
        # --max-cpu-loras: the adapters' in-flight requests and last use, to evict the least
        # recently used idle one when a load needs room.
        self.active: collections.Counter = collections.Counter()
        self.used: dict[str, float] = {}
        self._epoch: collections.Counter = collections.Counter()  # unloads per name
        self._unloaded: collections.OrderedDict[str, None] = collections.OrderedDict()

    def keys(self) -> dict[str, str]:
        return {name: key for name, (_, key) in self._loras.items()}

    def begin_use(self, name: str) -> None:
        self.active[name] += 1  # in use from here: never the one evicted to make room
        self.used[name] = time.monotonic()

    def end_use(self, name: str) -> None:
        self.active[name] -= 1

    async def add(
        self, name: str, path: str, timeout_s: Optional[float] = None, replace: bool = False, lazy: bool = False
    ) -> str:
        """Load an adapter as `name` and return its key (`name@digest`); a name held from the
        same files is a no-op. `lazy`: a request's load of an adapter it names, refused for a
        name unloaded here (LoRANotLoadable). ValueError when the adapter does not fit, the
        name is taken by other weights (unless `replace`), or the deadline passes."""
        if not self.args.enable_lora:
            raise ValueError("LoRA adapters need --enable-lora")
        if lazy and name in self._unloaded:
            raise LoRANotLoadable(name)
        if not lazy:
            self._unloaded.pop(name, None)
        loading = self._loading.get(name)
        if loading is not None:  # one load per name at a time; the others wait for it
            return await asyncio.shield(loading)
        timeout_s = self.args.lora_load_timeout if timeout_s is None else timeout_s
        task = asyncio.ensure_future(self._load(name, path, timeout_s, replace))
        self._loading[name] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._loading.pop(name, None)
            else:
                task.add_done_callback(lambda _: self._loading.pop(name, None))

    def _check(self, name: str, path: str) -> tuple[str, str]:
        """(the folder to read, the key): the path checks and the digest (on a thread)."""
        real = self.policy.resolve(path)
        read_adapter_config(real, f"LoRA adapter '{name}'")
        return real, f"{name}@{adapter_digest(real)}"

    async def _load(self, name: str, path: str, timeout_s: float, replace: bool) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        epoch = self._epoch[name]
        try:
            real, key = await asyncio.wait_for(loop.run_in_executor(None, self._check, name, path), timeout_s)
        except asyncio.TimeoutError:
            logger.warning("LoRA adapter %r: checking %s took over %g s", name, path, timeout_s)
            raise ValueError(timeout_text(name, timeout_s)) from None
        except (LoRAFileError, OSError) as e:
            logger.warning("LoRA adapter %r could not be loaded: %s", name, e)
            raise LoRANotLoadable(name) from None
        async with self._admin:  # one eviction and load at a time: the cap holds
            if self._epoch[name] != epoch:
                raise LoRANotLoadable(name)  # unloaded while its files were checked
            return await self._attach(name, real, key, deadline, timeout_s, replace, epoch)

    async def _attach(
        self, name: str, path: str, key: str, deadline: float, timeout_s: float, replace: bool, epoch: int
    ) -> str:
        held = self._loras.get(name)
        if held is not None:
            if held[1] == key:
                return key
            if not replace:
                raise ValueError(f"a LoRA adapter named {name!r} is loaded already (other weights); unload it first")
            logger.info("LoRA adapter %r: the weights held (%s) give way to %s", name, held[1], key)
            self._drop(name)
        await self._make_room(name)
        lora_id = self._next_id
        self._next_id += 1
        future = self._client.add_lora(lora_id, name, path)  # answered on this loop
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        self._core_loading[name] = lora_id
        try:
            error = await asyncio.wait_for(asyncio.wrap_future(future), remaining + ANSWER_MARGIN_S)
        except asyncio.TimeoutError:
            self._client.remove_lora(lora_id)  # whenever it lands, it goes again
            raise ValueError(timeout_text(name, timeout_s)) from None
        finally:
            self._core_loading.pop(name, None)
        if self._epoch[name] != epoch:  # unloaded while it loaded (remove cancelled the core's load)
            if error is None:
                self._client.remove_lora(lora_id)
            raise LoRANotLoadable(name)
        if error is not None:
            raise LoRANotLoadable(name) if is_not_loadable(error) else ValueError(error)
        self._loras[name] = (lora_id, key)
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, lora_id)
        return key

    async def _make_room(self, name: str) -> None:
        cap = self.args.max_cpu_loras
        if cap is None or len(self._loras) < cap:
            return
        idle = [n for n in self._loras if n != name and not self.active[n]]
        if not idle:
            raise LoRACapacityError(
                f"the {cap} LoRA adapters this replica may hold (--max-cpu-loras) "
                f"are all in use; {name!r} cannot be loaded now, retry shortly"
            )
        victim = min(idle, key=lambda n: self.used.get(n, 0.0))
        logger.info("LoRA adapter %r evicted (least recently used) to make room for %r", victim, name)
        self._drop(victim)  # (not an unload: a request naming it loads it again)

    def remove(self, name: str) -> bool:
        """Unload adapter `name`: new requests for it are refused at once, a load of it under
        way is discarded, and requests built before cannot load it back; its weights go when
        the requests running with it end. False when it was neither held nor loading."""
        self._epoch[name] += 1
        self._unloaded[name] = None
        self._unloaded.move_to_end(name)
        while len(self._unloaded) > MAX_UNLOADED_NAMES:
            self._unloaded.popitem(last=False)
        loading = name in self._loading
        if name in self._core_loading:  # the core drops it, never installed
            self._client.remove_lora(self._core_loading.pop(name))
        held = self._drop(name)
        if held:
            logger.info("LoRA adapter %r unloaded", name)
        return held or loading

    def evict(self, name: str) -> bool:
        """Drop the weights of `name` (not an unload: a request naming it loads it again)."""
        return self._drop(name)

    def _drop(self, name: str) -> bool:
        held = self._loras.pop(name, None)
        if held is None:
            return False
        self._client.remove_lora(held[0])
        return True


__all__ = ["EngineLoRAs"]
