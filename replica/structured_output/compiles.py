"""Grammar compiles: a bounded worker pool, one compile per grammar spec, an LRU of results.

xgrammar compiles in C++ and cannot be interrupted, so a compile is bounded from outside:

- one compile per spec (`StructuredOutputsParams.key()`, canonical JSON for schemas): the
  requests that ask for a spec while it compiles join that compile (`waiters`);
- at most `max_workers` compiles run at once, so slow grammars hold at most that many
  threads and cores; the others queue behind them;
- a compile that no request waits for any more (all aborted or past their deadline) is
  dropped if it has not started; one that has started runs to its end (nothing can stop
  it), and its grammar is kept if it succeeded;
- finished grammars stay cached, the least recently used dropped past `cache_size`;
  compiles in flight are never dropped (there are at most as many as requests waiting).

Everything here except `_run` (pool threads) is called from the engine core's thread.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass(eq=False)
class Compile:
    """One spec's compile: its future (the compiled grammar), who waits for it, and when a
    worker started it (0.0 while it is queued)."""

    key: tuple
    future: cf.Future
    waiters: set[str] = field(default_factory=set)
    started: float = 0.0

    def running_s(self, now: float) -> float:
        """How long it has run so far (0.0 while queued)."""
        return now - self.started if self.started else 0.0


class GrammarCompiles:
    def __init__(
        self,
        compile_fn: Callable[[Any], Any],
        max_workers: int = 2,
        cache_size: int = 256,
        prepare_fn: Optional[Callable[[], object]] = None,
    ) -> None:
        """`compile_fn(params)` compiles on a pool thread, after `prepare_fn()` (the backend's
        one-time setup: not counted as the compile's running time)."""
        self._compile_fn = compile_fn
        self._prepare_fn = prepare_fn
        self.max_workers = max_workers
        self._cache_size = cache_size
        self._pool = cf.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="fleetserve-grammar", initializer=_lower_priority
        )
        self._entries: collections.OrderedDict[tuple, Compile] = collections.OrderedDict()
        self._running: set[Compile] = set()  # started and not finished (what holds the workers)
        self._running_lock = threading.Lock()

    def join(self, key: tuple, params: Any, request_id: str) -> Compile:
        """The compile of `key` with `request_id` among its waiters: the cached grammar, the
        one in flight, or a new compile (also when the last one failed)."""
        entry = self._entries.get(key)
        if entry is None or (entry.future.done() and (entry.future.cancelled() or entry.future.exception())):
            entry = Compile(key, cf.Future())
            entry.future = self._pool.submit(self._run, entry, params)
            self._entries[key] = entry
        self._entries.move_to_end(key)
        entry.waiters.add(request_id)
        self._evict()
        return entry

    def leave(self, entry: Compile, request_id: str) -> None:
        """`request_id` waits no more; a compile nobody waits for is dropped if it has not
        started (one that has runs to its end: its grammar, if any, stays cached)."""
        entry.waiters.discard(request_id)
        if not entry.waiters and not entry.future.done() and entry.future.cancel():
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]

    def running(self) -> list[Compile]:
        """The compiles the workers are running now."""
        with self._running_lock:
            return list(self._running)

    def youngest_start(self) -> float:
        """When the most recent of the running compiles started, with every worker busy
        (the pool has been full since then); 0.0 when a worker is free."""
        with self._running_lock:
            running = list(self._running)
        if len(running) < self.max_workers:
            return 0.0
        return max(e.started for e in running)

    def __len__(self) -> int:
        return len(self._entries)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _evict(self) -> None:
        """Drop the least recently used finished grammars past the cache's size."""
        excess = len(self._entries) - self._cache_size
        for key in [k for k, e in self._entries.items() if e.future.done()][: max(excess, 0)]:
            del self._entries[key]

    def _run(self, entry: Compile, params: Any) -> Any:
        """A pool thread: compile, marking the entry running meanwhile."""
        if self._prepare_fn is not None:
            self._prepare_fn()
        with self._running_lock:
            entry.started = time.monotonic()
            self._running.add(entry)
        try:
            return self._compile_fn(params)
        finally:
            with self._running_lock:
                self._running.discard(entry)


# How much nicer than the engine's step loop a compile thread runs (Linux: per thread). A
# grammar compile is seconds of CPU that the decoding streams of the same replica would
# otherwise share equally; at nice 10 the kernel gives a busy step loop about ten times the
# CPU a compile gets, so slow grammars delay their own requests, not everyone's tokens. The
# threads xgrammar starts from a compile thread inherit it.
COMPILE_NICE = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: compiles run at the loop's priority
        pass


def first_done(entries: list[Compile], timeout_s: float) -> None:
    """Wait up to `timeout_s` for one of the compiles to finish."""
    futures = [e.future for e in entries]
    if timeout_s > 0 and futures and not any(f.done() for f in futures):
        cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
