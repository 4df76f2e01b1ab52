"""Property-based tests: random workloads, invariants after every step, exact tokens.

The fake model computes every token from the simulated KV cache (see utils), so
"same tokens as an unpreempted run" also checks that prefix-cache hits,
preemption, connector loads (including failed ones) and block reuse never
feed a request wrong KV.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.scheduler import Request, SamplingParams
from tests.scheduler.utils import (
    EOS,
    VOCAB,
    ConnectorPlan,
    FakeModelRunner,
    FakeProposer,
    TestConnector,
    create_scheduler,
    reference_tokens,
    step,
)

PREFIXES = [[(7 * k + j) % (VOCAB - 1) + 1 for j in range(24)] for k in range(3)]


@st.composite
def workloads(draw, with_connector: bool, with_spec: bool = False):
    block_size = draw(st.sampled_from([1, 2, 4]))
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(8, 48))
    budget = draw(st.integers(max_model_len if not chunked else 1, 64))
    config = dict(
        block_size=block_size,
        num_blocks=draw(st.one_of(st.integers(2, 12), st.integers(2, 40))),
        enable_prefix_caching=draw(st.booleans()),
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority", "sjf"])),
        capacity_policy=draw(st.sampled_from(["max_utilization", "guaranteed_no_evict", "reserve_predicted"])),
    )
    if with_spec:
        config["num_spec_tokens"] = draw(st.integers(1, 5))
        config["num_lookahead_tokens"] = draw(st.sampled_from([0, 0, config["num_spec_tokens"]]))
        config["adaptive_draft_length"] = draw(st.booleans())
        config["free_draft_tokens"] = draw(st.sampled_from([0, 8, 64]))
        config["proposer_seed"] = draw(st.integers(0, 2**16))
    reqs = []
    for i in range(draw(st.integers(2, 10))):
        plen = draw(st.integers(1, 40))
        shared = draw(st.sampled_from([None, 0, 1, 2]))
        if shared is None:
            prompt = [(11 * i + 3 * j) % (VOCAB - 1) + 1 for j in range(plen)]
        else:
            prompt = (PREFIXES[shared] + [(i + j) % (VOCAB - 1) + 1 for j in range(plen)])[:plen]
        sp = SamplingParams(
            max_tokens=draw(st.integers(1, 16)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        )
        sp.min_tokens = draw(st.integers(0, sp.max_tokens))
        plan = None
        if with_connector and draw(st.booleans()):
            plan = ConnectorPlan(
                num_external=draw(st.integers(0, 40)),
                is_async=draw(st.booleans()),
                load_delay=draw(st.integers(0, 3)),
                fail_block=draw(st.one_of(st.none(), st.integers(0, 6))),
                ask_later=draw(st.integers(0, 2)),
                delay_free=draw(st.integers(-1, 2)),
            )
        reqs.append(
            dict(
                rid=f"q{i}",
                prompt=prompt,
                sp=sp,
                priority=draw(st.integers(0, 3)),
                salt=draw(st.sampled_from([None, None, "a"])),
                arrive=draw(st.one_of(st.just(0), st.integers(0, 15))),
                abort=draw(st.one_of(st.none(), st.none(), st.integers(0, 40))),
                plan=plan,
            )
        )
    return config, reqs


def run_workload(config, reqs, with_connector: bool) -> None:
    plans = {r["rid"]: r["plan"] for r in reqs if r["plan"] is not None}
    connector = TestConnector(plans) if with_connector else None
    config = dict(config)
    proposer = None
    if "proposer_seed" in config:
        proposer = FakeProposer(config["num_spec_tokens"], config.pop("proposer_seed"))
    sched = create_scheduler(connector=connector, **config)
    runner = FakeModelRunner(config["num_blocks"], config["block_size"], connector, proposer)
    by_id: dict[str, Request] = {}
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    aborted: set[str] = set()
    max_step = max(r["arrive"] for r in reqs)
    for t in range(5000):
        for r in reqs:
            if r["arrive"] == t:
                req = Request(
                    r["rid"],
                    r["prompt"],
                    r["sp"],
                    eos_token_id=EOS,
                    arrival_time=float(t),
                    priority=r["priority"],
                    cache_salt=r["salt"],
                )
                by_id[r["rid"]] = req
                sched.add_request(req)
            if r["abort"] == t and r["rid"] in by_id:
                aborted.update(sched.abort_requests([r["rid"]]))
        if t > max_step and not sched.has_requests():
            break
        _, outs = step(sched, runner)
        for rid, o in outs.items():
            assert rid not in reasons, f"{rid} produced output after finishing"
            tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[rid] = o.finish_reason
    else:
        raise AssertionError(f"not idle: {sched.get_stats()}")

    # Idle: every block is free and nothing is left anywhere.
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.requests and not sched.has_unfinished_requests()
    for rid, req in by_id.items():
        assert req.is_finished, rid
        got = tokens.get(rid, [])
        want = reference_tokens(req, config["max_model_len"])
        if rid in aborted:
            assert got == want[: len(got)], rid
            continue
        assert rid in reasons, f"{rid} never finished"
        if req.get_finished_reason() == "length" and not got:
            assert req.num_prompt_tokens >= min(
                config["max_model_len"], config["num_blocks"] * config["block_size"] + 1
            )
            continue
        assert got == want, (rid, got, want)


SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@SETTINGS
@given(workloads(with_connector=False))
def test_random_workloads(workload):
    run_workload(*workload, with_connector=False)


@SETTINGS
@given(workloads(with_connector=True))
def test_random_workloads_with_connector(workload):
    run_workload(*workload, with_connector=True)


@SETTINGS
@given(workloads(with_connector=False, with_spec=True))
def test_random_workloads_with_spec_decode(workload):
    """Draft tokens (right, wrong, cut by the budget or max_model_len) change
    nothing: same tokens, invariants after every step, no leaked blocks."""
    run_workload(*workload, with_connector=False)


@SETTINGS
@given(workloads(with_connector=True, with_spec=True))
def test_random_workloads_with_spec_decode_and_connector(workload):
    run_workload(*workload, with_connector=True)
