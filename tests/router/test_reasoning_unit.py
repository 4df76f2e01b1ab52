"""Reasoning parsers (router/api/reasoning.py): whole outputs as vLLM's parsers read them, and
streams split at every possible point read the same way, a tag split across deltas included."""

from __future__ import annotations

import pytest

from fleetserve.router.api.reasoning import get_parser

CASES = {
    "deepseek_r1": [
        ("let me see</think>Paris", ("let me see", "Paris")),
        ("<think>let me see</think>Paris", ("let me see", "Paris")),
        ("still thinking when the length ran out", ("still thinking when the length ran out", None)),
        ("all thought</think>", ("all thought", None)),
        ("a < b </thin and more</think> x", ("a < b </thin and more", " x")),
    ],
    "qwen3": [
        ("<think>hmm</think>Paris", ("hmm", "Paris")),
        ("  <think>hmm</think>\n\nParis", ("hmm", "\n\nParis")),
        ("Paris", (None, "Paris")),
        ("<thinking is fun", (None, "<thinking is fun")),
        ("a <think>x</think> b", ("x", " b")),
    ],
}


@pytest.mark.parametrize("name,text,expected", [(n, t, e) for n, cases in CASES.items() for t, e in cases])
def test_whole_outputs_split_as_vllm_s_parsers(name, text, expected):
    assert get_parser(name).split(text) == expected


@pytest.mark.parametrize("name,text", [(n, t) for n, cases in CASES.items() for t, _ in cases])
def test_every_way_of_streaming_reads_as_the_whole(name, text):
    parser = get_parser(name)
    whole = parser.split(text)
    for cuts in ([i] for i in range(len(text) + 1)):
        pieces = [text[: cuts[0]], text[cuts[0] :]]
        for step in (1, 2, 3):  # and char by char, in pairs, in threes
            pieces_s = [text[i : i + step] for i in range(0, len(text), step)]
            for ps in (pieces, pieces_s):
                s = parser.streamer()
                got = [s.feed(p, final=(k == len(ps) - 1)) for k, p in enumerate(ps)]
                thought = "".join(r for r, _ in got) or None
                content = "".join(c for _, c in got) or None
                if name == "qwen3" and not text.lstrip().startswith("<think>"):
                    # A stream only thinks when it opens with the tag; text before it is content.
                    assert (thought, content) == (None, text), (ps, got)
                    continue
                assert (thought, content) == whole, (ps, got)
                # Nothing of a tag leaks into either part.
                assert all("</think>" not in r + c for r, c in got)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_parser("nope")
    assert get_parser(None) is None
