"""router/bodies.py's tokenization, with a recording tokenizer: a truncating request's prompt
is cut to the tail that can hold the context before it is tokenized (the character bound
applies to every request), and a long text is tokenized on a worker thread, never on the
ingress's loop."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from fleetserve.router.api.errors import APIError
from fleetserve.router.bodies import OFF_LOOP_CHARS, TAIL_SLACK_TOKENS, BodyBuilder


class RecordingTokenizer:
    """One character, one token; records what it was given and on which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, text: str, add_special_tokens: bool = True):
        self.calls.append((len(text), threading.current_thread() is threading.main_thread()))
        return SimpleNamespace(input_ids=[ord(c) % 100 for c in text])

    def __len__(self) -> int:
        return 100


class Pools:
    def __init__(self, tok, max_model_len: int) -> None:
        self._info = {"tokenizer": tok, "max_model_len": max_model_len, "max_token_chars": 4}

    async def info(self) -> dict:
        return self._info


def _builder(max_model_len: int = 64):
    tok = RecordingTokenizer()
    return BodyBuilder(Pools(tok, max_model_len), loras=None), tok


def test_truncating_request_tokenizes_only_the_tail():
    bodies, tok = _builder()
    prompt = "x" * 1_000_000 + "end"
    ids = asyncio.run(bodies.tokenize_prompt(prompt, True, "prompt", truncating=True))
    tail = (64 + TAIL_SLACK_TOKENS) * 4
    assert [n for n, _ in tok.calls] == [tail]
    assert ids[-3:] == [ord(c) % 100 for c in "end"]


def test_untruncated_long_prompt_is_refused_by_characters_without_tokenizing():
    bodies, tok = _builder()
    with pytest.raises(APIError) as e:
        asyncio.run(bodies.tokenize_prompt("y" * 300, True, "prompt"))
    assert e.value.body["error"]["code"] == "context_length_exceeded" and tok.calls == []


def test_long_texts_are_tokenized_off_the_loop_and_short_ones_on_it():
    bodies, tok = _builder(max_model_len=8192)
    asyncio.run(bodies.tokenize_prompt("z" * 100, True, "prompt", truncating=True))
    asyncio.run(bodies.tokenize_prompt("z" * (OFF_LOOP_CHARS * 2), True, "prompt", truncating=True))
    (short_len, short_on_loop), (long_len, long_on_loop) = tok.calls
    assert short_on_loop and not long_on_loop
    assert long_len > OFF_LOOP_CHARS
