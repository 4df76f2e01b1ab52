"""Incremental detokenization: equals a full decode, never splits a character,
never leaks a stop string."""

from __future__ import annotations

import random

import pytest

from fleetserve.replica.engine.detokenizer import IncrementalDetokenizer
from fleetserve.scheduler.sampling_params import SamplingParams

TEXTS = [
    "Hello world, how are you today?",
    "héllo 🎉 世界 naïve café — ünïcödé ✓",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox 🦊 jumps over the lazy dog 🐶.",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def stream(tok, prompt_ids, output_ids, chunks=1, flush=True, **params):
    """Feed `output_ids` in chunks of `chunks` ids; returns (deltas, stop string)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    deltas, stop = [], None
    for i in range(0, len(output_ids), chunks):
        delta, stop = detok.update(output_ids[i : i + chunks])
        deltas.append(delta)
        if stop is not None:
            break
    if flush and stop is None:
        deltas.append(detok.flush())
    assert "".join(deltas) == detok.output_text
    return deltas, stop


def full_decode(tok, prompt_ids, output_ids, skip=True):
    """The output's text as a whole decode shows it (after the prompt's text)."""
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=skip)
    return tok.decode(prompt_ids + output_ids, skip_special_tokens=skip)[len(prompt_text) :]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [1, 3])
def test_incremental_equals_full_decode(tok, text, chunks):
    prompt = tok.encode("user: say something\n")
    ids = tok.encode(text)
    deltas, stop = stream(tok, prompt, ids, chunks=chunks)
    assert stop is None
    assert "".join(deltas) == text == full_decode(tok, prompt, ids)
    # A character split over byte tokens is never emitted half-done.
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_are_split_over_tokens(tok):
    # The premise of the test above: the tiny tokenizer has no merges for these.
    ids = tok.encode("🎉")
    assert len(ids) == 4 and all(tok.decode([i]) == "\ufffd" for i in ids)
    deltas, _ = stream(tok, [], ids, flush=False)
    assert deltas == ["", "", "", "🎉"]


def test_random_ids_match_full_decode(tok):
    rng = random.Random(0)
    for _ in range(50):
        prompt = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(0, len(tok)) for _ in range(rng.randrange(1, 40))]
        deltas, _ = stream(tok, prompt, ids, chunks=rng.randrange(1, 4))
        assert "".join(deltas) == full_decode(tok, prompt, ids)


def test_skip_special_tokens(tok):
    ids = tok.encode("Hello") + [2] + tok.encode(" world")
    assert "".join(stream(tok, [], ids)[0]) == "Hello world"
    assert "".join(stream(tok, [], ids, skip_special_tokens=False)[0]) == "Hello<|im_end|> world"


def check_no_leak(deltas, final_text):
    emitted = ""
    for d in deltas:
        emitted += d
        assert final_text.startswith(emitted)
    assert emitted == final_text


@pytest.mark.parametrize("stop", ["o wor", "world", "w", "d, how", ", h"])
def test_stop_string_truncates_and_never_leaks(tok, stop):
    text = "Hello world, how are you today?"
    ids = tok.encode(text)
    deltas, matched = stream(tok, [], ids, stop=[stop])
    assert matched == stop
    check_no_leak(deltas, text[: text.index(stop)])


def test_stop_string_spanning_tokens_is_held_back(tok):
    text = "Hello world, how are you today?"
    ids = tok.encode(text)
    stop = "o wor"  # 'o' ends one token, ' w' and 'or' are the next ones
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop]))
    emitted = ""
    for i in ids:
        delta, matched = detok.update([i])
        emitted += delta
        # Never a character of the stop string, not even its first one.
        assert "o w" not in emitted and not emitted.endswith("o")
        if matched:
            break
    assert matched == stop and emitted == "Hell"


def test_include_stop_str_in_output(tok):
    text = "Hello world, how are you today?"
    deltas, matched = stream(tok, [], tok.encode(text), stop=["world"], include_stop_str_in_output=True)
    assert matched == "world"
    check_no_leak(deltas, "Hello world")


def test_false_start_is_released(tok):
    # "wo" could begin "wonder": held until "r" rules it out, then released.
    text = "Hello world, how are you today?"
    deltas, matched = stream(tok, [], tok.encode(text), stop=["wonder"], flush=False)
    assert matched is None
    assert "".join(deltas) == text  # the final ? cannot begin "wonder"


def test_flush_releases_held_tail(tok):
    text = "Hello w"
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["wonder"]))
    delta, matched = detok.update(tok.encode(text))
    assert matched is None and delta == "Hello "
    assert detok.flush() == "w"
    assert detok.output_text == text


def test_earliest_of_several_stops_wins(tok):
    text = "Hello world, how are you today?"
    deltas, matched = stream(tok, [], tok.encode(text), chunks=50, stop=["how", "world", "?"])
    assert matched == "world"
    check_no_leak(deltas, "Hello ")


def test_multibyte_stop_string(tok):
    text = "héllo 🎉 世界 naïve"
    deltas, matched = stream(tok, [], tok.encode(text), stop=["🎉 世"])
    assert matched == "🎉 世"
    check_no_leak(deltas, "héllo ")
    assert all("\ufffd" not in d for d in deltas)


def test_stop_within_min_tokens_is_ignored(tok):
    ids = tok.encode("ab ab ab")
    per_token = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    first_ab = next(i for i, t in enumerate(per_token) if "ab" in t) + 1
    deltas, matched = stream(tok, [], ids, stop=["ab"], min_tokens=first_ab)
    assert matched == "ab"
    check_no_leak(deltas, "ab ")


def test_update_after_stop_is_ignored(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world"]))
    _, matched = detok.update(tok.encode("Hello world"))
    assert matched == "world" and detok.finished
    assert detok.update(tok.encode(" more")) == ("", None)
    assert detok.flush() == "" and detok.output_text == "Hello "


class _CountingBackend:
    def __init__(self, backend):
        self.backend, self.longest = backend, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class _CountingTokenizer:
    def __init__(self, tok):
        self.backend_tokenizer = _CountingBackend(tok.backend_tokenizer)


def test_each_update_decodes_a_short_window(tok):
    counting = _CountingTokenizer(tok)
    ids = tok.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(counting, tok.encode("a long prompt " * 50), SamplingParams(stop=["zzz"]))
    text = "".join(detok.update([i])[0] for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert counting.backend_tokenizer.longest <= 12  # a few ids, however long the output


@pytest.mark.parametrize(
    "text,stops,min_tokens",
    [
        ("Hello world, how are you today?", ["o wor"], 0),
        ("Hello world, how are you today?", ["wonder", "you t"], 0),
        ("héllo 🎉 世界 naïve café", ["🎉 世"], 0),
        ("héllo 🎉 世界 naïve café", [], 0),
        ("ab ab ab ab", ["ab"], 4),
    ],
)
def test_a_continuation_replays_the_cut_output_and_goes_on_as_without_the_cut(tok, text, stops, min_tokens):
    """A migration continuation (continued_output_tokens=c) cut at every point: what the first
    detokenizer handed out before the cut plus what the continuation's hands out equals the
    uninterrupted text, the same stop matches (one straddling the cut too), and a character
    whose bytes the cut split is not lost."""
    prompt = tok.encode("user: say something\n")
    ids = tok.encode(text)
    whole, whole_stop = stream(tok, prompt, ids, stop=stops, min_tokens=min_tokens)
    for cut in range(1, len(ids)):
        first = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=stops, min_tokens=min_tokens))
        sent, stop = first.update(ids[:cut])
        if stop is not None:
            break  # ended before the cut: nothing to continue
        rest, rest_stop = stream(
            tok,
            prompt + ids[:cut],
            ids[cut:],
            stop=stops,
            min_tokens=max(0, min_tokens - cut),
            continued_output_tokens=cut,
        )
        assert sent + "".join(rest) == "".join(whole), (cut, sent, rest)
        assert rest_stop == whole_stop, cut
