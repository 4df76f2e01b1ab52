"""Trace records, readers, writers and generators of the fleet simulator (fleetserve/sim)."""

from __future__ import annotations

import statistics

import pytest

from fleetserve.sim.generators import Lengths, generate, sample_traces
from fleetserve.sim.traces import SAMPLES_DIR, TraceError, TraceRequest, detect_format, read_trace, write_trace


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


# --- the record and token ids ---------------------------------------------------------


def test_prompt_forms_are_validated():
    with pytest.raises(ValueError, match="one of prompt_tokens"):
        TraceRequest(arrival_s=0, output_tokens=1)
    with pytest.raises(ValueError, match="exactly one"):
        TraceRequest(arrival_s=0, output_tokens=1, prompt_token_ids=[1], hash_ids=[1])
    with pytest.raises(ValueError, match=r"prompt_tokens must lie in \(512, 1024\]"):
        TraceRequest(arrival_s=0, output_tokens=1, hash_ids=[1, 2], prompt_tokens=100)
    r = TraceRequest(arrival_s=0, output_tokens=1, hash_ids=[1, 2], prompt_tokens=600)
    assert r.num_prompt_tokens == 600 and len(r.token_ids()) == 600
    assert TraceRequest(arrival_s=0, output_tokens=1, hash_ids=[1, 2]).num_prompt_tokens == 1024


def test_token_ids_share_exactly_the_leading_blocks():
    a = TraceRequest(arrival_s=0, output_tokens=1, hash_ids=[7, 8, 9], block_tokens=16)
    b = TraceRequest(arrival_s=1, output_tokens=1, hash_ids=[7, 8, 10, 11], block_tokens=16, prompt_tokens=50)
    c = TraceRequest(arrival_s=2, output_tokens=1, hash_ids=[5, 8, 9], block_tokens=16)
    ta, tb, tc = a.token_ids(vocab_size=50000), b.token_ids(vocab_size=50000), c.token_ids(vocab_size=50000)
    assert ta[:32] == tb[:32] and ta[32:48] != tb[32:48] and len(tb) == 50
    assert ta[:16] != tc[:16]  # same later ids behind a different first block: not a shared prefix
    assert ta == a.token_ids(vocab_size=50000)  # deterministic (and cached)
    assert all(0 <= t < 50000 for t in ta)
    # plain counts share nothing with each other
    p = TraceRequest(arrival_s=0, output_tokens=1, prompt_tokens=64, request_id="0").token_ids()
    q = TraceRequest(arrival_s=0, output_tokens=1, prompt_tokens=64, request_id="1").token_ids()
    assert len(p) == 64 and p[:16] != q[:16]
    ids = TraceRequest(arrival_s=0, output_tokens=1, prompt_token_ids=[3, 4, 5]).token_ids()
    assert ids == [3, 4, 5]


# --- readers ----------------------------------------------------------------------------


def test_read_ours_normalises_and_round_trips(tmp_path):
    p = _write(
        tmp_path,
        "t.jsonl",
        '{"arrival_s": 12.5, "prompt_tokens": 10, "output_tokens": 3, "tenant": "a"}\n'
        "\n"
        '{"arrival_s": 10.0, "hash_ids": [1, 2], "block_tokens": 16, "output_tokens": 4, "priority": 2}\n'
        '{"arrival_s": 11.0, "prompt_token_ids": [5, 6], "output_tokens": 1, "session": "s", "request_id": "x"}\n',
    )
    reqs = read_trace(p)
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.5]
    assert reqs[0].hash_ids == (1, 2) and reqs[0].num_prompt_tokens == 32 and reqs[0].priority == 2
    assert reqs[1].request_id == "x" and reqs[2].request_id == "1" and reqs[2].tenant == "a"
    out = tmp_path / "again.jsonl"
    write_trace(out, reqs)
    assert read_trace(out) == reqs


def test_read_mooncake(tmp_path):
    p = _write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50,'
        " 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}\n"
        '{"timestamp": 30535, "input_length": 1000, "output_length": 5, "hash_ids": [46, 2355]}\n',
    )
    assert detect_format(p) == "mooncake"
    a, b = read_trace(p)
    assert a.arrival_s == 0.0 and b.arrival_s == pytest.approx(3.053)
    assert a.num_prompt_tokens == 6955 and a.block_tokens == 512 and a.output_tokens == 52
    assert a.token_ids()[:512] == b.token_ids()[:512] and a.token_ids()[512:600] != b.token_ids()[512:600]


def test_read_azure_datetimes_and_seconds(tmp_path):
    p = _write(
        tmp_path,
        "AzureLLMInferenceTrace_conv.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:47.0000000,100,0\n",
    )
    a, b = read_trace(p)  # the row with 0 generated tokens is skipped
    assert b.arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert (a.prompt_tokens, a.output_tokens) == (374, 44)
    q = _write(tmp_path, "s.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n5.5,10,2\n3.0,20,1\n")
    assert [(r.arrival_s, r.prompt_tokens) for r in read_trace(q)] == [(0.0, 20), (2.5, 10)]


def test_read_burstgpt_skips_failures(tmp_path):
    p = _write(
        tmp_path,
        "BurstGPT_1.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n",
    )
    assert detect_format(p) == "burstgpt"
    a, b = read_trace(p)
    assert (a.arrival_s, a.tenant, a.prompt_tokens, a.output_tokens) == (0.0, "ChatGPT", 472, 18)
    assert (b.arrival_s, b.tenant) == (113.0, "GPT-4")


def test_format_can_be_forced(tmp_path):
    p = _write(tmp_path, "trace.txt", '{"timestamp": 0, "input_length": 10, "output_length": 2}\n')
    assert read_trace(p, format="mooncake")[0].prompt_tokens == 10
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(p, format="nope")


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "trace.jsonl",
            '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n' * 6
            + '{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": -3}\n',
            "trace.jsonl line 7: output_tokens must be a positive integer, got -3",
        ),
        ("t.jsonl", '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n{oops\n', "t.jsonl line 2: not JSON"),
        ("t.jsonl", '{"arrival_s": 0, "prompt_tokens": 5}\n', "t.jsonl line 1: output_tokens is missing"),
        (
            "t.jsonl",
            '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1, "tenatn": "a"}\n',
            "t.jsonl line 1: tenatn is not a trace field",
        ),
        (
            "t.jsonl",
            '{"arrival_s": "soon", "prompt_tokens": 5, "output_tokens": 1}\n',
            "t.jsonl line 1: arrival_s must be a finite number",
        ),
        (
            "t.jsonl",
            '{"arrival_s": 0, "hash_ids": [1, -2], "output_tokens": 1}\n',
            "t.jsonl line 1: hash_ids must be a non-empty list",
        ),
        (
            "m.jsonl",
            '{"timestamp": 0, "input_length": 10, "output_length": 2}\n'
            '{"timestamp": 1, "input_length": 0, "output_length": 2}\n',
            "m.jsonl line 2: input_length must be a positive integer, got 0",
        ),
        (
            "m.jsonl",
            '{"timestamp": 0, "input_length": 2000, "output_length": 2, "hash_ids": [1]}\n',
            r"m.jsonl line 1: prompt_tokens must lie in \(0, 512\]",
        ),
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\n2023-11-16 18:15:47,ten,2\n",
            "a.csv line 3: ContextTokens must be an integer, got 'ten'",
        ),
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n",
            "a.csv line 2: TIMESTAMP must be seconds or a datetime",
        ),
        (
            "b.csv",
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,5,-1,4,API log\n",
            "b.csv line 2: Response tokens must be a non-negative integer, got -1",
        ),
        ("b.csv", "Timestamp,Model,Request tokens\n1,ChatGPT,5\n", "b.csv line 1: column Response tokens is missing"),
        ("e.jsonl", "\n\n", "e.jsonl: empty trace"),
    ],
)
def test_bad_input_names_file_line_and_field(tmp_path, name, text, message):
    p = _write(tmp_path, name, text)
    with pytest.raises(TraceError, match=message):
        read_trace(p)


# --- shipped samples --------------------------------------------------------------------


def test_shipped_samples_match_the_generators():
    expected = sample_traces()
    shipped = {p.name for p in SAMPLES_DIR.iterdir()}
    assert shipped == set(expected), "run `python -m fleetserve.sim.traces regenerate`"
    for name, text in expected.items():
        assert (SAMPLES_DIR / name).read_text() == text, (
            f"{name} drifted: run `python -m fleetserve.sim.traces regenerate`"
        )


@pytest.mark.parametrize(
    "name, fmt, count",
    [
        ("poisson.jsonl", "jsonl", 300),
        ("bursty.jsonl", "jsonl", 300),
        ("shared_prefix.jsonl", "jsonl", 300),
        ("multiturn.jsonl", "jsonl", 300),
        ("mooncake_sample.jsonl", "mooncake", 20),
        ("azure_sample.csv", "azure", 20),
        ("burstgpt_sample.csv", "burstgpt", 18),  # two failed rows (0 response tokens) skipped
    ],
)
def test_shipped_samples_read(name, fmt, count):
    assert detect_format(SAMPLES_DIR / name) == fmt
    reqs = read_trace(SAMPLES_DIR / name)
    assert len(reqs) == count and reqs[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))


# --- generators -------------------------------------------------------------------------

KINDS = ["poisson", "bursty", "long_tail", "shared_prefix", "multiturn"]


@pytest.mark.parametrize("kind", KINDS)
def test_generators_are_deterministic_under_a_seed(kind, tmp_path):
    a = generate(kind, num_requests=200, rate=5.0, seed=11)
    assert a == generate(kind, num_requests=200, rate=5.0, seed=11)
    assert a != generate(kind, num_requests=200, rate=5.0, seed=12)
    assert len(a) == 200 and a[0].arrival_s == 0.0
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    write_trace(tmp_path / "g.jsonl", a)
    assert read_trace(tmp_path / "g.jsonl") == a


def test_generate_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown trace kind"):
        generate("zipf", num_requests=1, rate=1.0)


def _gaps(reqs):
    return [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]


def test_poisson_rate_and_bursty_cv():
    gaps = _gaps(generate("poisson", num_requests=4000, rate=8.0, seed=3))
    assert 1.0 / statistics.fmean(gaps) == pytest.approx(8.0, rel=0.06)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.1)
    gaps = _gaps(generate("bursty", num_requests=4000, rate=8.0, seed=3, cv=3.0))
    assert 1.0 / statistics.fmean(gaps) == pytest.approx(8.0, rel=0.2)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) > 1.5


def test_long_tail_lengths_are_clipped_and_skewed():
    reqs = generate(
        "long_tail", num_requests=3000, rate=5.0, seed=2, prompt=Lengths(100, lo=10, hi=5000, kind="pareto")
    )
    lens = [r.prompt_tokens for r in reqs]
    assert min(lens) >= 10 and max(lens) <= 5000 and max(lens) > 10 * statistics.median(lens)


def test_shared_prefix_tenants_share_their_system_prompt_only():
    reqs = generate("shared_prefix", num_requests=300, rate=5.0, seed=1, num_tenants=4, system_prompt_tokens=256)
    by_tenant = {}
    for r in reqs:
        by_tenant.setdefault(r.tenant, []).append(r)
    assert len(by_tenant) == 4
    prefixes = set()
    for rs in by_tenant.values():
        heads = {r.hash_ids[:16] for r in rs}
        assert len(heads) == 1  # 256 tokens = 16 blocks of 16 tokens, shared by the tenant
        assert len({r.hash_ids[16:17] for r in rs}) == len(rs)  # the user part is unique
        prefixes |= heads
        t0, t1 = rs[0].token_ids(), rs[1].token_ids()
        assert t0[:256] == t1[:256] and t0[256:272] != t1[256:272]
    assert len(prefixes) == 4
    a, b = (rs[0] for rs in list(by_tenant.values())[:2])
    assert a.token_ids()[:16] != b.token_ids()[:16]


def test_multiturn_prompts_extend_the_previous_turn():
    reqs = generate("multiturn", num_requests=120, rate=2.0, seed=5, turns=4, think_s=3.0)
    sessions = {}
    for r in sorted(reqs, key=lambda r: r.request_id):
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 30
    for turns in sessions.values():
        assert len(turns) == 4
        for prev, cur in zip(turns, turns[1:]):
            assert cur.arrival_s > prev.arrival_s
            assert cur.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            full = prev.prompt_tokens // cur.block_tokens
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            n = full * cur.block_tokens
            assert cur.token_ids()[:n] == prev.token_ids()[:n]
            assert cur.hash_ids[full:].count(prev.hash_ids[-1]) == 0
