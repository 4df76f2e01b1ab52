"""Output-length-aware scheduling through a real engine (a tiny random Llama, the core on a
thread so its scheduler can be read): a request's session and prediction given to
AsyncEngine.generate reach the scheduler's Request, requests without one are predicted
there, every request finishes, and the scheduler learns and counts the errors."""

from __future__ import annotations

import asyncio

from fleetserve.replica.engine.async_engine import AsyncEngine
from fleetserve.scheduler import SamplingParams


def test_sjf_engine_predicts_learns_and_takes_a_given_prediction(tiny_model_dir):
    engine = AsyncEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=4,
        max_num_seqs=2,
        max_model_len=96,
        num_threads=1,
        scheduling_policy="sjf",
        capacity_policy="reserve_predicted",
        core_process=False,
    )
    seen: dict[str, tuple] = {}
    sched = engine.core.scheduler
    add = sched.add_request

    def spy(request):
        add(request)
        seen[request.request_id] = (request.session, request.predicted_output_tokens)

    sched.add_request = spy

    async def one(i: int, **kw) -> int:
        n = 0
        sp = SamplingParams(max_tokens=4 + 6 * (i % 2), ignore_eos=True)
        async for out in engine.generate([3 + i, 5, 7, 9], sp, f"q{i}", **kw):
            n += len(out.outputs[0].token_ids)  # each output carries its new tokens
        return n

    async def run():
        first = await asyncio.gather(*(one(i) for i in range(6)))
        given = await one(6, session="chat-1", predicted_output_tokens=3)
        return first, given

    try:
        first, given = asyncio.run(run())
        assert first == [4, 10, 4, 10, 4, 10] and given == 4
        assert seen["q6"] == ("chat-1", 3)
        assert all(seen[f"q{i}"][1] is not None for i in range(6))  # predicted in the scheduler
        stats = sched.get_stats()
        assert stats.length_num_predicted == 7 == sum(stats.length_error_counts)
        assert sched.lengths.predictor.num_observed == 7
    finally:
        engine.shutdown()
