"""Output-length-aware scheduling runs in the simulator unchanged: a trace's client
max_tokens and session reach the real scheduler, requests end by EOS at their lengths, the
scheduler's own predictor learns from them, and sjf cuts the median latency of a long-tailed
mix against fcfs while serving the same requests."""

from __future__ import annotations

from fleetserve.sim.cluster import Cluster
from fleetserve.sim.generators import generate
from fleetserve.sim.traces import TraceRequest, format_trace, read_trace

from .test_sim_core import LinearCost, _args


def _run(policy: str, trace, **kw):
    cluster = Cluster(
        LinearCost(), 1, "power_of_two", _args(num_blocks=1200, scheduling_policy=policy, max_num_seqs=4, **kw)
    )
    return cluster.run(trace), cluster


def test_max_tokens_and_sessions_reach_the_scheduler_and_requests_end_by_eos():
    trace = [
        TraceRequest(0.0, 7, prompt_tokens=40, max_tokens=100, session="s", tenant="t", request_id="a"),
        TraceRequest(0.1, 5, prompt_tokens=40, request_id="b"),
    ]
    cluster = Cluster(LinearCost(), 1, "power_of_two", _args(num_blocks=200, scheduling_policy="sjf"))
    seen = []
    scheduler = cluster.replicas[0].scheduler
    add = scheduler.add_request

    def spy(request):
        seen.append((request.sampling_params.max_tokens, request.sampling_params.ignore_eos, request.session))
        add(request)

    scheduler.add_request = spy  # type: ignore[method-assign]
    result = cluster.run(trace)
    assert seen == [(100, False, "s"), (5, True, None)]
    reasons = {r.trace_id: (r.finish_reason, r.num_output) for r in result.records}
    assert reasons == {"a": ("stop", 7), "b": ("length", 5)}
    assert result.length_prediction is not None and result.length_prediction["requests"] == 2


def test_trace_max_tokens_round_trips(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(format_trace([TraceRequest(0.0, 3, prompt_tokens=10, max_tokens=16, session="a")]))
    (r,) = read_trace(path)
    assert (r.max_tokens, r.session) == (16, "a")


def test_sjf_beats_fcfs_on_a_long_tailed_mix():
    trace = generate("length_mix", num_requests=100, rate=30.0, seed=2)
    n = sum(1 for r in trace if r.num_prompt_tokens < 4096)  # the rest exceed max_model_len
    fcfs, _ = _run("fcfs", trace)
    sjf, cluster = _run("sjf", trace)
    assert fcfs.completed == sjf.completed == n
    assert fcfs.length_prediction is None
    lp = sjf.length_prediction
    assert lp is not None and lp["requests"] == n
    assert lp["mae_tokens"] < lp["mean_output_tokens"]  # it learned something
    assert sjf.ttft_s["p50"] < 0.7 * fcfs.ttft_s["p50"], (sjf.ttft_s, fcfs.ttft_s)
    assert sjf.e2e_s["p50"] < fcfs.e2e_s["p50"], (sjf.e2e_s, fcfs.e2e_s)
    assert cluster.replicas[0].scheduler.lengths.predictor.num_observed > 0
