"""Grammar compiles have a deadline, a cache and cancellation, and a stall shows in health.

The manager tests compile real xgrammar grammars for the tiny model's tokenizer; where a test
needs a compile that takes long, the compile callable is the real one held at a gate (it
waits on an event, with a deadline), so the timing is the test's and not the machine's. One
manager test and the engine-level ones use a constraint that is slow in xgrammar itself and
passes validation: a choice among 5000 phrases (seconds to compile even for the tiny
model's 384 tokens)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from fleetserve.replica.engine.tokenizer import load_tokenizer
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.structured_output.backend import XgrammarBackend
from fleetserve.replica.structured_output.manager import StructuredOutputManager
from fleetserve.scheduler import Request, SamplingParams, StructuredOutputsParams
from fleetserve.scheduler.structured_outputs import parse_grammar_error

EOS = 2
SIMPLE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def many_optional_properties(n: int) -> dict:
    """A small schema per n (the gated tests' distinct specs)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def slow_choice(tag: str = "") -> StructuredOutputsParams:
    """A constraint xgrammar compiles slowly: 5000 choices (9.8 s on the tiny tokenizer, 2
    shared cores; 2000 choices: 0.1 s)."""
    return StructuredOutputsParams(choice=[f"option number {i} with text{tag}" for i in range(5000)])


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    tokenizer = load_tokenizer(resolve_model(str(tiny_model_dir)))
    return XgrammarBackend(tokenizer, len(tokenizer), EOS)


class Gated:
    """The real compile, held at a gate for the specs named in `slow` (until `open()`, at most
    10 s); counts the compiles of each spec it started."""

    def __init__(self, backend, slow=()) -> None:
        self.backend, self.slow = backend, {StructuredOutputsParams(json=s).key() for s in slow}
        self.gate = threading.Event()
        self.started: Counter = Counter()

    def __call__(self, params):
        self.started[params.key()] += 1
        if params.key() in self.slow:
            assert self.gate.wait(10), "the test never opened the gate"
        return self.backend.compile(params)

    def open(self) -> None:
        self.gate.set()


def manager(backend, compile_fn=None, timeout_s=10.0, workers=2, cache_size=256) -> StructuredOutputManager:
    return StructuredOutputManager(
        lambda: backend, max_workers=workers, compile_timeout_s=timeout_s, compile_fn=compile_fn, cache_size=cache_size
    )


def request(rid: str, schema) -> Request:
    so = schema if isinstance(schema, StructuredOutputsParams) else StructuredOutputsParams(json=schema)
    return Request(rid, [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=so), EOS)


def settle(m: StructuredOutputManager, rids, limit_s: float = 10.0):
    """take_ready until every one of `rids` is ready or failed: ({rid: Request}, {rid: output})."""
    ready, failed = {}, {}
    deadline = time.monotonic() + limit_s
    while set(rids) - set(ready) - set(failed):
        assert time.monotonic() < deadline, f"still pending: {m.pending_ids()}"
        got, outs = m.take_ready(wait_s=0.01)
        ready.update((r.request_id, r) for r in got)
        failed.update((o.request_id, o) for o in outs)
    return ready, failed


def code_of(output) -> str:
    assert output.finish_reason == "error" and output.new_token_ids == []
    parsed = parse_grammar_error(output.stop_reason)
    assert parsed is not None, output.stop_reason
    return parsed[0]


def until(predicate, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


# ---- the manager ---------------------------------------------------------------------


def test_a_grammar_past_its_deadline_ends_its_request_and_the_others_go_on(backend):
    slow = many_optional_properties(3)
    gated = Gated(backend, slow=[slow])
    m = manager(backend, gated, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        m.submit(request("slow", slow))
        m.submit(request("fast", SIMPLE))
        ready, failed = settle(m, ["slow", "fast"])
        assert list(ready) == ["fast"] and list(failed) == ["slow"]
        assert code_of(failed["slow"]) == "grammar_compile_timeout"
        assert "did not compile within 0.3 s" in failed["slow"].stop_reason
        assert 0.3 <= time.monotonic() - t0 < 5
        assert not m.has_pending()
        # The late compile still finishes (it cannot be stopped) and is kept: the next request
        # with that schema gets it at once.
        gated.open()
        until(lambda: not m.compiling())
        m.submit(request("again", slow))
        ready, _ = settle(m, ["again"], limit_s=1.0)
        assert list(ready) == ["again"] and gated.started[StructuredOutputsParams(json=slow).key()] == 1
    finally:
        gated.open()
        m.shutdown()


def test_a_request_queued_behind_busy_workers_is_told_to_retry_and_its_compile_is_dropped(backend):
    slow, queued = many_optional_properties(3), many_optional_properties(4)
    gated = Gated(backend, slow=[slow])
    m = manager(backend, gated, timeout_s=0.3, workers=1)
    try:
        m.submit(request("slow", slow))
        until(lambda: m.compiling())
        m.submit(request("queued", queued))
        _, failed = settle(m, ["slow", "queued"])
        assert code_of(failed["slow"]) == "grammar_compile_timeout"
        assert code_of(failed["queued"]) == "grammar_compile_busy"
        assert "retry later" in failed["queued"].stop_reason
        gated.open()
        until(lambda: not m.compiling())
        time.sleep(0.05)  # a dropped compile would have started by now
        assert gated.started[StructuredOutputsParams(json=queued).key()] == 0  # never compiled
    finally:
        gated.open()
        m.shutdown()


def test_one_compile_per_schema_shared_while_in_flight_and_cached_lru(backend):
    gated = Gated(backend, slow=[SIMPLE])
    m = manager(backend, gated, cache_size=2)
    try:
        same = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}  # keys reordered
        m.submit(request("r1", SIMPLE))
        m.submit(request("r2", same))
        assert m.take_ready(wait_s=0.05) == ([], [])  # both wait on the one compile at the gate
        gated.open()
        ready, failed = settle(m, ["r1", "r2"])
        assert sorted(ready) == ["r1", "r2"] and not failed
        key = StructuredOutputsParams(json=SIMPLE).key()
        assert gated.started[key] == 1
        m.submit(request("r3", SIMPLE))  # a cache hit: ready at once, nothing compiled
        assert [r.request_id for r in m.take_ready()[0]] == ["r3"] and gated.started[key] == 1
        for i, n in enumerate((2, 3)):  # two more schemas: SIMPLE is the least recently used
            m.submit(request(f"other{i}", many_optional_properties(n)))
        settle(m, ["other0", "other1"])
        assert len(m.compiles) == 2
        m.submit(request("r4", SIMPLE))
        settle(m, ["r4"])
        assert gated.started[key] == 2  # evicted, so compiled again
    finally:
        gated.open()
        m.shutdown()


def test_an_abort_stops_the_wait_and_drops_a_compile_nobody_waits_for(backend):
    slow, queued = many_optional_properties(3), many_optional_properties(4)
    gated = Gated(backend, slow=[slow])
    m = manager(backend, gated, workers=1)
    try:
        m.submit(request("running", slow))
        until(lambda: m.compiling())
        m.submit(request("queued", queued))
        m.remove(["queued", "running"])  # both clients went away
        assert not m.has_pending() and m.take_ready(wait_s=0.01) == ([], [])
        gated.open()
        until(lambda: not m.compiling())
        time.sleep(0.05)
        assert gated.started[StructuredOutputsParams(json=queued).key()] == 0  # dropped unstarted
        # The started one ran to its end and is kept.
        m.submit(request("later", slow))
        assert [r.request_id for r in m.take_ready(wait_s=0.5)[0]] == ["later"]
        assert gated.started[StructuredOutputsParams(json=slow).key()] == 1
    finally:
        gated.open()
        m.shutdown()


def test_a_schema_slow_in_xgrammar_misses_a_short_deadline(backend):
    """No gate: xgrammar's own compile of a 5000-way choice against a 0.15 s deadline; a
    small schema on the other worker is fine."""
    m = manager(backend, timeout_s=0.15)
    try:
        m.backend()  # built already: its one-time setup is not what this measures
        m.submit(request("slow", slow_choice()))
        m.submit(request("fast", {"type": "integer"}))
        ready, failed = settle(m, ["slow", "fast"])
        assert list(failed) == ["slow"] and code_of(failed["slow"]) == "grammar_compile_timeout"
        until(lambda: not m.compiling())
    finally:
        m.shutdown()


def test_stalled_since_marks_workers_stuck_past_the_deadline(backend):
    gated = Gated(backend, slow=[many_optional_properties(3), many_optional_properties(4)])
    m = manager(backend, gated, timeout_s=0.2, workers=2)
    try:
        m.submit(request("a", many_optional_properties(3)))
        assert m.stalled_since() == 0.0
        m.submit(request("b", many_optional_properties(4)))
        settle(m, ["a", "b"])  # both past the deadline; their compiles hold both workers
        until(lambda: m.stalled_since() > 0)
        assert 0 < m.stalled_since() < time.monotonic()
        gated.open()
        until(lambda: not m.compiling())
        assert m.stalled_since() == 0.0
    finally:
        gated.open()
        m.shutdown()


# ---- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "a{1,10000}"},
        {"type": "object", "patternProperties": {"^x{5000}$": {"type": "string"}}},
        {"type": "array", "items": {"type": "string", "pattern": "[a-z]{1000}[0-9]{1000}[A-Z]{1000}-{1000}_{500}"}},
    ],
)
def test_patterns_that_xgrammar_converts_in_quadratic_time_are_refused_up_front(schema):
    """`a{1,10000}` in a schema's pattern took 8 s in xgrammar's schema front end (on the
    replica's event loop, before any deadline applies)."""
    with pytest.raises(ValueError, match="structured_outputs.json: the pattern"):
        StructuredOutputsParams(json=schema)


def test_patterns_within_the_bounds_are_kept():
    params = StructuredOutputsParams(json={"type": "string", "pattern": "^[a-z]{1,64}@[a-z]{2,10}$"})
    assert params.kind == "json"


# ---- the engine, the replica's error item, and health -----------------------------------


def assert_no_leak(core) -> None:
    sched = core.scheduler
    assert not sched.has_unfinished_requests() and not core.structured.has_pending()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_engine_a_grammar_past_its_deadline_errors_while_a_normal_request_finishes(tiny_model_dir):
    from fleetserve.replica.llm import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, structured_outputs_compile_timeout=0.15)
    try:
        llm.core.structured.backend()  # the tokenizer's one-time setup, out of the way
        slow = SamplingParams(max_tokens=8, structured_outputs=slow_choice())
        free = SamplingParams(max_tokens=8, ignore_eos=True)
        failed, normal = llm.generate(["Answer:", "Hello"], [slow, free], use_tqdm=False)
        assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
        assert parse_grammar_error(failed.outputs[0].stop_reason)[0] == "grammar_compile_timeout"
        assert normal.outputs[0].finish_reason == "length" and len(normal.outputs[0].token_ids) == 8
        assert_no_leak(llm.core)
        until(lambda: not llm.core.structured.compiling())
        # Still serving constrained requests afterwards.
        choice = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        (out,) = llm.generate(["Answer:"], [choice], use_tqdm=False)
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
        assert_no_leak(llm.core)
    finally:
        llm.shutdown()


def test_replica_answers_a_missed_deadline_with_an_openai_error(tiny_model_dir):
    import asyncio

    from fleetserve.router.api.protocol import sampling_dict
    from fleetserve.router.replica import EngineReplica

    replica = EngineReplica(
        {
            "model": str(tiny_model_dir),
            "num_threads": 1,
            "num_gpu_blocks_override": 32,
            "structured_outputs_compile_timeout": 0.15,
        },
        "fleetserve.replica.engine.async_engine:AsyncEngine",
    )

    def body(rid, **params):
        sp = sampling_dict(SamplingParams(**params))
        return {"request_id": rid, "prompt_token_ids": [5, 6, 7], "sampling_params": sp, "priority": 0}

    async def items(gen):
        return [i for item in [x async for x in gen] for i in (item if isinstance(item, list) else [item])]

    async def go():
        # The first constrained requests also wait for the tokenizer's one-time setup in the
        # core process, longer than this deadline: told to retry (503) until it is done.
        warm = StructuredOutputsParams(json={"type": "integer"})
        deadline = time.monotonic() + 60
        for i in range(1000):
            last = (await items(replica.generate(body(f"warm{i}", max_tokens=2, structured_outputs=warm))))[-1]
            if "error" not in last:
                break
            assert last["status"] == 503 and last["error"]["code"] == "grammar_compile_busy", last
            assert "retry later" in last["error"]["message"] and time.monotonic() < deadline
            await asyncio.sleep(0.1)
        so = slow_choice()
        (error,) = await items(replica.generate(body("slow", max_tokens=4, structured_outputs=so)))
        assert error["status"] == 400, error
        assert error["error"]["code"] == "grammar_compile_timeout"
        assert error["error"]["param"] == "structured_outputs" and error["error"]["type"] == "invalid_request_error"
        assert "did not compile within 0.15 s" in error["error"]["message"]
        served = await items(replica.generate(body("free", max_tokens=3, ignore_eos=True)))
        assert sum(len(o["token_ids"]) for i in served for o in i["outputs"]) == 3
        load = replica.engine.get_load()
        assert load["num_free_blocks"] == load["num_blocks"] and load["num_waiting"] == 0

    try:
        asyncio.run(go())
    finally:
        replica.engine.shutdown()


def test_health_reports_workers_stuck_past_the_deadline_then_recovers(tiny_model_dir):
    """Both compile workers held by compiles past the deadline (xgrammar's own: two 5000-way
    choices, seconds each), in a core process: the requests end at their deadline, and the
    health check says the grammar compiles stalled until the workers are free again."""
    import asyncio

    from fleetserve.replica.engine.async_engine import AsyncEngine, EngineDeadError

    engine = AsyncEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        core_process=True,
        structured_outputs_compile_timeout=0.2,
    )

    async def final(so: StructuredOutputsParams):
        sp = SamplingParams(max_tokens=4, structured_outputs=so)
        return [o async for o in engine.generate("Answer:", sp)][-1].outputs[0]

    async def health(limit_s: float, want_healthy: bool):
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                engine.check_health(stall_timeout_s=0.5)
                if want_healthy:
                    return None
            except EngineDeadError as e:
                if not want_healthy:
                    return str(e)
            await asyncio.sleep(0.05)
        raise AssertionError(f"health never became {'healthy' if want_healthy else 'unhealthy'}")

    async def go():
        engine.check_health(stall_timeout_s=0.5)
        outs = await asyncio.gather(final(slow_choice("a")), final(slow_choice("b")))
        for out in outs:  # the first request also paid for the tokenizer's setup: timeout or busy
            assert out.finish_reason == "error" and parse_grammar_error(out.stop_reason) is not None
        reason = await health(20, want_healthy=False)
        assert "grammar compile stalled" in reason, reason
        await health(60, want_healthy=True)  # the compiles end: healthy again
        out = await final(StructuredOutputsParams(json={"type": "integer"}))
        assert out.finish_reason in ("stop", "length") and out.token_ids
        load = engine.get_load()
        assert load["num_free_blocks"] == load["num_blocks"] and load["num_waiting"] == 0

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()


def test_objects_with_many_optional_properties_are_refused_up_front():
    """2000 optional properties in one object took 118 s to compile for SmolLM2's tokenizer."""
    with pytest.raises(ValueError, match="257 optional properties"):
        StructuredOutputsParams(json=many_optional_properties(257))
    wide = {"type": "object", "properties": {f"o{j}": many_optional_properties(256) for j in range(4)}}
    with pytest.raises(ValueError, match="1028 optional properties"):
        StructuredOutputsParams(json=wide)
    required = {**many_optional_properties(2000), "required": [f"p{i}" for i in range(2000)]}
    assert StructuredOutputsParams(json=required).kind == "json"  # required ones compile fast
