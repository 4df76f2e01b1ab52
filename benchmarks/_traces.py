"""Scheduler-overhead traces, shared by fleetserve's half and vLLM's half.

A trace drives any scheduler through a small adapter (`make_request`,
`add_request`, `schedule`, `update`) and times only
`schedule()` + `update_from_output()`; building the fake model output is not
counted. Everything is deterministic, so both schedulers see the same work.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

BLOCK_SIZE = 16
DECODE_SIZES = [16, 128, 512, 2048]


def trace_specs() -> list[dict[str, Any]]:
    specs = []
    for caching in (True, False):
        for n in DECODE_SIZES:
            specs.append(dict(name=f"decode-{n}", kind="decode", n=n, prefix_caching=caching))
        specs.append(dict(name="mixed", kind="mixed", n=256, prefix_caching=caching))
    return specs


def sched_params(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["kind"] == "decode":
        n = spec["n"]
        return dict(
            num_blocks=n * 20 + 64,
            block_size=BLOCK_SIZE,
            max_num_seqs=n,
            max_num_batched_tokens=8192,
            max_model_len=4096,
            prefix_caching=spec["prefix_caching"],
        )
    return dict(
        num_blocks=8192,
        block_size=BLOCK_SIZE,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        prefix_caching=spec["prefix_caching"],
    )


def _prompt(i: int, length: int, system: int) -> list[int]:
    # 32 tokens of one of four shared "system prompts", then request-specific tokens.
    head = [1000 + 17 * system + j for j in range(min(32, length))]
    return head + [(i * 7919 + j * 31) % 29000 + 2000 for j in range(length - len(head))]


def run_trace(spec: dict[str, Any], adapter: Any, repeats: int) -> dict[str, Any]:
    """Returns per-step microseconds (median of `repeats` timed windows)."""
    sched = adapter.build(**sched_params(spec))
    step_no = [0]
    counter = [0]

    def add(n: int, length: Callable[[int], int], max_tokens: Callable[[int], int]) -> None:
        for _ in range(n):
            i = counter[0]
            counter[0] += 1
            adapter.add_request(sched, adapter.make_request(f"req-{i}", _prompt(i, length(i), i % 4), max_tokens(i)))

    def one_step() -> float:
        t0 = time.perf_counter()
        so = adapter.schedule(sched)
        t1 = time.perf_counter()
        runner_output = adapter.fake_runner_output(sched, so, step_no[0])
        t2 = time.perf_counter()
        adapter.update(sched, so, runner_output)
        t3 = time.perf_counter()
        step_no[0] += 1
        return (t1 - t0) + (t3 - t2)

    if spec["kind"] == "decode":
        n = spec["n"]
        add(n, lambda i: 48, lambda i: 100_000)
        # Warm up until every request is decoding (one token each per step).
        for _ in range(200):
            one_step()
            if adapter.num_running(sched) == n and adapter.last_total(sched) == n:
                break
        steps = 30 if n <= 512 else 10
    else:
        lengths = [96, 300, 700, 1500]

        def arrivals() -> None:
            add(2, lambda i: lengths[i % 4] + i % 13, lambda i: 16 + (i * 37) % 112)

        for _ in range(60):
            arrivals()
            one_step()
        steps = 30
    windows = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(steps):
            if spec["kind"] == "mixed":
                arrivals()
            total += one_step()
        windows.append(total / steps * 1e6)
    return dict(us_per_step=statistics.median(windows), windows=windows, running=adapter.num_running(sched))
