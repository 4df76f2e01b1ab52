"""The continuation a migrated request is resumed with (router.routing.migration) produces the
tokens the uninterrupted request would have, on a real engine: greedy, and seeded sampling
(the seed shift must match the model runner's reseeding). No Ray needed."""

from __future__ import annotations

import asyncio

import pytest

from fleetserve.router.routing.migration import (
    ENGINE_DEAD,
    MIGRATED_KEY,
    MigratingStream,
    continuation_body,
    continued_seed,
)
from fleetserve.scheduler import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from fleetserve.replica.engine.async_engine import AsyncEngine

    e = AsyncEngine(
        model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, core_process=False, num_threads=1
    )
    yield e
    e.shutdown()


def _tokens(engine, prompt_ids, sp_dict, rid):
    async def go():
        ids = []
        async for out in engine.generate(list(prompt_ids), SamplingParams(**sp_dict), rid):
            ids += out.outputs[0].token_ids
        return ids

    return asyncio.run(go())


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 1234},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7, "repetition_penalty": 1.2},
        {"temperature": 0.0, "frequency_penalty": 2.0, "presence_penalty": 1.5},
        {"temperature": 1.0, "seed": 99, "frequency_penalty": -2.0},
    ],
    ids=["greedy", "seeded", "seeded-top-p-k-repetition", "greedy-frequency-presence", "seeded-frequency"],
)
def test_continuation_equals_uninterrupted_run(engine, sampling):
    prompt = [5, 17, 42, 99, 3, 250, 77]
    sp = {"max_tokens": 24, "ignore_eos": True, "min_tokens": 10, **sampling}
    body = {"request_id": f"orig-{sampling.get('seed')}", "prompt_token_ids": prompt, "sampling_params": sp}
    full = _tokens(engine, prompt, sp, body["request_id"])
    assert len(full) == 24
    for cut in (1, 9, 23):
        cont = continuation_body(body, full[:cut], attempt=1, avoid=["dead-replica"])
        assert cont["sampling_params"]["max_tokens"] == 24 - cut
        assert cont["sampling_params"]["min_tokens"] == max(0, 10 - cut)
        assert cont["_fleetserve_avoid_replicas"] == ["dead-replica"]
        rest = _tokens(engine, cont["prompt_token_ids"], cont["sampling_params"], f"{cont['request_id']}-{cut}")
        assert full[:cut] + rest == full, (cut, full, rest)
    load = engine.get_load()
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]


def test_bad_words_and_grammars_split_by_the_failure_stay_whole(engine):
    """A bad word whose first token came before the failure, and a grammar the failure cut in
    the middle: the continuation goes on as the uninterrupted run (which the fields change)."""
    prompt = [5, 17, 42, 99, 3, 250, 77]
    plain = {"max_tokens": 16, "ignore_eos": True, "temperature": 0.0}
    free = _tokens(engine, prompt, plain, "bw-free")
    # Ban the two tokens around the cut (their first occurrence): the run must avoid the second.
    cut = next(c for c in range(2, len(free)) if (free[c - 1], free[c]) not in set(zip(free[: c - 1], free[1:c])))
    banned = {**plain, "bad_words_token_ids": [[free[cut - 1], free[cut]]]}
    regex = {**plain, "max_tokens": 30, "structured_outputs": {"regex": r"\((a|b|c)+, (d|e)+\)"}}
    for i, sp in enumerate((banned, regex)):
        body = {"request_id": f"split-{i}", "prompt_token_ids": prompt, "sampling_params": sp}
        full = _tokens(engine, prompt, sp, body["request_id"])
        if sp is banned:
            assert full[:cut] == free[:cut] and full[cut] != free[cut]
        for at in (cut, cut - 1) if sp is banned else (2, 5):
            cont = continuation_body(body, full[:at], attempt=1, avoid=[])
            assert cont["sampling_params"]["continued_output_tokens"] == at
            rest = _tokens(engine, cont["prompt_token_ids"], cont["sampling_params"], f"split-{i}-{at}")
            assert full[:at] + rest == full, (sp, at, full, rest)
    # Continued output that the grammar cannot have produced: the request ends, with a reason.
    wrong = {**regex, "continued_output_tokens": 2}

    async def one():
        return [o async for o in engine.generate(prompt, SamplingParams(**wrong), "split-wrong")][-1]

    last = asyncio.run(one())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    with pytest.raises(ValueError, match="continued_output_tokens"):
        _tokens(engine, prompt, {**plain, "continued_output_tokens": len(prompt)}, "split-long")
    load = engine.get_load()
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]


def test_continued_seed_inverts_the_reseeding_stride():
    for seed in (0, 1, 1234, (1 << 63) - 1):
        for k in (0, 1, 5, 1000):
            assert (continued_seed(seed, k) * 1_000_003) % (1 << 63) == (seed * 1_000_003 + k) % (1 << 63)


class _FakeStream:
    """A replica stream: yields `items` (an Exception instance is raised in its place)."""

    def __init__(self, items):
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def _out(replica, tokens_by_choice, finished=False):
    return {
        "replica": replica,
        "outputs": [
            {"index": i, "text": "", "token_ids": ids, "finish_reason": "length" if finished else None}
            for i, ids in enumerate(tokens_by_choice)
        ],
    }


def _dead(replica):
    return {
        "status": 503,
        "replica": replica,
        "error": {"message": "the engine is dead", "type": "ServiceUnavailableError", "code": ENGINE_DEAD},
    }


def _collect(stream):
    async def go():
        return [item async for item in stream]

    return asyncio.run(go())


@pytest.mark.parametrize("first", ["dead-item", "raised"])
def test_n_gt_1_before_any_token_is_sent_again_whole(first):
    body = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "sampling_params": {"n": 2, "max_tokens": 2, "seed": 9}}
    opened = []
    streams = [
        _FakeStream([_dead("A") if first == "dead-item" else RuntimeError("actor died")]),
        _FakeStream([_out("B", [[7], [8]]), _out("B", [[9], [10]], finished=True)]),
    ]

    def open_stream(b):
        opened.append(b)
        return streams[len(opened) - 1]

    stream = MigratingStream(open_stream, body, max_migrations=2, backoff_s=0)
    items = _collect(stream)
    assert [o["token_ids"] for i in items for o in i["outputs"]] == [[7], [8], [9], [10]]
    assert stream.migrations == 1 and streams[0].cancelled
    retry = opened[1]
    # The whole request again: same prompt, budget and seed; the dead replica avoided.
    assert retry["prompt_token_ids"] == [1, 2, 3]
    assert {k: retry["sampling_params"][k] for k in ("n", "max_tokens", "seed")} == body["sampling_params"]
    assert retry[MIGRATED_KEY] == 1
    if first == "dead-item":
        assert retry["_fleetserve_avoid_replicas"] == ["A"]


def test_n_gt_1_after_tokens_is_not_continued():
    body = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "sampling_params": {"n": 2, "max_tokens": 4}}
    streams = [_FakeStream([_out("A", [[7], [8]]), RuntimeError("actor died")])]
    stream = MigratingStream(lambda b: streams.pop(0), body, max_migrations=2, backoff_s=0)

    async def go():
        got = [await stream.__anext__()]
        with pytest.raises(RuntimeError, match="actor died"):
            await stream.__anext__()
        return got

    assert len(asyncio.run(go())) == 1 and stream.migrations == 0
