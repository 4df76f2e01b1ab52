"""Structured outputs on a tiny random-weight model: whatever the weights, an output that
finishes with "stop" is in the constraint's language; free requests are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fleetserve.replica.llm import LLM
from fleetserve.replica.structured_output.backend import XgrammarBackend
from fleetserve.scheduler import SamplingParams, StructuredOutputsParams

# Few examples, each a batch of many constraints: a step costs the same for 1 or 16 rows.
# No shrinking: each example is a batch on a model, and shrinking one took minutes.
SETTINGS = settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=256)


def run(llm, constraint: dict, seeds=range(4), max_tokens=64, prompt="Answer:"):
    """Sampled (temperature 1) outputs of `constraint` for each seed."""
    return [outs[0] for outs in run_many(llm, [constraint], seeds, max_tokens, prompt)]


def run_many(llm, constraints: list[dict], seeds, max_tokens, prompt="Answer:"):
    """One batch: per constraint, its outputs for each seed."""
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**c))
        for c in constraints
        for s in seeds
    ]
    outs = [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    k = len(list(seeds))
    return [outs[i * k : (i + 1) * k] for i in range(len(constraints))]


def assert_clean(llm):
    sched = llm.core.scheduler
    assert not sched.has_unfinished_requests() and not llm.core.structured.has_pending()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not llm.core.structured.has_matchers()


# ---- JSON schemas --------------------------------------------------------------------

names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda vs: {"enum": vs}, st.lists(st.text(alphabet="xyz AB", max_size=4), min_size=1, max_size=3, unique=True)
    ),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"type": "number"}),
)


def objects(children):
    def build(props, data):
        required = [k for k in props if data.draw(st.booleans())]
        return {"type": "object", "properties": props, "required": required}

    return st.builds(build, st.dictionaries(names, children, min_size=1, max_size=3), st.data())


schemas = st.recursive(
    leaves,
    lambda children: st.one_of(
        objects(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    ),
    max_leaves=5,
)


def test_json_schemas_validate_whatever_the_weights(llm):
    stopped = []

    @SETTINGS
    @given(cases=st.lists(st.tuples(schemas, st.booleans()), min_size=6, max_size=6))
    def check(cases):
        constraints = [{"json": schema, "disable_any_whitespace": compact} for schema, compact in cases]
        for (schema, _), outs in zip(cases, run_many(llm, constraints, range(2), 48)):
            for out in outs:
                if out.finish_reason == "stop":
                    jsonschema.validate(json.loads(out.text), schema)
                    stopped.append(out.text)

    check()
    assert len(stopped) >= 15, "too few outputs finished to mean anything"
    assert_clean(llm)


def test_json_object(llm):
    outs = run(llm, {"json_object": True}, seeds=range(6), max_tokens=96)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done
    for o in done:
        assert isinstance(json.loads(o.text), (dict, list))


# ---- regexes, choices, grammars ------------------------------------------------------------

atoms = st.sampled_from(["[a-c]", "[0-9]", "x", "(ab|cd)", "[A-Z]", r"\.", "-", "[xyz]"])
quantifiers = st.sampled_from(["", "?", "{2}", "{1,3}", "{0,2}"])
regexes = st.lists(st.tuples(atoms, quantifiers).map("".join), min_size=1, max_size=5).map("".join)


def test_regexes(llm):
    stopped = []

    @SETTINGS
    @given(patterns=st.lists(regexes, min_size=8, max_size=8))
    def check(patterns):
        for regex, outs in zip(patterns, run_many(llm, [{"regex": r} for r in patterns], range(2), 24)):
            for out in outs:
                if out.finish_reason == "stop":
                    assert re.fullmatch(regex, out.text), (regex, out.text)
                    stopped.append(out.text)

    check()
    assert len(stopped) >= 30


def test_choices(llm):
    choice_lists = st.lists(st.text(alphabet="abc xyz,!é", min_size=1, max_size=8), min_size=1, max_size=4, unique=True)

    @SETTINGS
    @given(lists=st.lists(choice_lists, min_size=8, max_size=8))
    def check(lists):
        for choices, outs in zip(lists, run_many(llm, [{"choice": c} for c in lists], range(2), 24)):
            for out in outs:
                if out.finish_reason == "stop":
                    assert out.text in choices

    check()
    # With a short list, everything finishes: the grammar ends after a handful of tokens.
    assert all(o.finish_reason == "stop" and o.text in ("yes", "no") for o in run(llm, {"choice": ["yes", "no"]}))
    assert_clean(llm)


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = run(llm, {"grammar": grammar}, seeds=range(6), max_tokens=32)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done
    for o in done:
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", o.text), o.text


def test_grammar_end_stops_even_with_ignore_eos(llm):
    """The grammar terminating ends the request with "stop", EOS or not."""
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
    )
    (out,) = llm.generate("Pick:", sp, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("alpha", "beta")
    assert_clean(llm)


# ---- batches mixing constrained and free requests ----------------------------------------------


def test_free_requests_unchanged_by_constrained_neighbours(llm):
    prompts = ["The quick brown fox", "Hello, world!", "def add(a, b):", "Numbers 0 1 2"]
    free = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=12, ignore_eos=True),
    ]
    alone = llm.generate(prompts[:3], free, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=12, structured_outputs=so)
        for s, so in enumerate(
            [
                StructuredOutputsParams(regex="[0-9]{3,9}"),
                StructuredOutputsParams(json_object=True),
                StructuredOutputsParams(choice=["yes", "no"]),
            ]
        )
    ]
    mixed = llm.generate(
        prompts[3:] + prompts[:3] + prompts[3:] * 2, [constrained[0]] + free + constrained[1:], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed[1:4]] == [o.outputs[0].token_ids for o in alone]
    assert re.fullmatch("[0-9]{3,9}", mixed[0].outputs[0].text) or mixed[0].outputs[0].finish_reason == "length"
    assert mixed[-1].outputs[0].text in ("yes", "no")
    assert_clean(llm)


# ---- bad constraints --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "constraint,match",
    [
        ({"json": {"type": "nonsense"}}, "invalid JSON schema"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a(b"}, "invalid regular expression"),
        ({"grammar": "root ::= undefined_rule"}, "invalid grammar"),
        ({"choice": []}, "non-empty list"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ],
)
def test_bad_constraints_are_value_errors(llm, constraint, match):
    with pytest.raises(ValueError, match=match):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    # Still serves, nothing held.
    assert run(llm, {"choice": ["ok"]}, seeds=[0])[0].text == "ok"
    assert_clean(llm)


def test_backend_exact_on_non_ascii_and_control_characters(llm):
    """Regressions found by the tests above (xgrammar 0.2.8 quirks, worked around in backend.py):
    'éb' came out as U+0E9B, and a bounded JSON string let a raw control character in.
    (accept_string accepts prefixes too, so each bad text leaves the language early.)"""
    import xgrammar

    backend = XgrammarBackend(llm.tokenizer, llm.core.hf_config.vocab_size, llm.tokenizer.eos_token_id)

    def accepts(constraint, text):
        return xgrammar.GrammarMatcher(backend.compile(StructuredOutputsParams(**constraint))).accept_string(text)

    for constraint, good, bad in [
        ({"choice": ["éb", "x"]}, "éb", "\u0e9b"),
        ({"regex": "éb[0-9]"}, "éb1", "\u0e9b1"),
        ({"json": {"enum": ["éa", "ບx"]}}, '"éa"', '"\u0e9a"'),
        ({"json": {"type": "string", "maxLength": 3}}, '"ab"', '"a\x10"'),
        ({"choice": ['q"uo\\te', "tab\there"]}, "tab\there", "tab here"),
    ]:
        assert accepts(constraint, good), (constraint, good)
        assert not accepts(constraint, bad), (constraint, bad)


def test_sampler_bitmask_and_logit_bias_rows():
    """Only the constrained rows are masked (a padded LM head's view too); logit_bias adds."""
    import torch

    from fleetserve.replica.layers.sampler import Sampler, SamplingBatch, apply_token_bitmask

    big = torch.zeros(4, 80)
    logits = big[:, :70]
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[0, 0] = 0b101  # row 1: tokens 0 and 2
    mask[1, 2] = 1  # row 3: token 64
    apply_token_bitmask(logits, torch.tensor([1, 3]), mask)
    allowed = [(logits[r] == 0).nonzero().flatten().tolist() for r in range(4)]
    assert allowed[1] == [0, 2] and allowed[3] == [64] and allowed[0] == allowed[2] == list(range(70))
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [[1], [1]], [[], []], [None, None], None, 70, "cpu")
    batch.token_bitmask = (torch.tensor([1]), mask[1:])
    out = Sampler()(torch.zeros(2, 70), batch)
    assert out.sampled_token_ids == [7, 64]
