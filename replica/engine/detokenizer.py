"""Incremental detokenization with stop strings, one instance per request.

Decoding token by token is wrong for byte-level BPE (a character's UTF-8 bytes
may be split over tokens) and for SentencePiece (a token's leading space
depends on what precedes it). vLLM's answer, kept here: decode a short window
of ids twice and emit the difference.

    all ids:  ... p p p p p | r r r | n          p: prompt, r/n: output
                            ^prefix ^read        (offsets into all ids)
    prefix_text = decode(ids[prefix:read])
    new_text    = decode(ids[prefix:])          delta = new_text[len(prefix_text):]

If `new_text` ends in U+FFFD the last character is still incomplete: emit
nothing and wait for more ids (the offsets stay). Otherwise emit the delta and
slide the window: prefix <- read, read <- len(ids). Each update decodes a
handful of ids, so the cost is O(new tokens), not O(output).

Stop strings. The decoded output is held in `_text` (a window: text handed
out long ago is dropped); `_emitted` characters of it were handed out. After
each token we look for a stop string in the part of `_text` that could contain
a new match, and otherwise hand out everything
except the longest tail that is a prefix of some stop string (it might be
the start of one). With `include_stop_str_in_output` nothing needs holding
back: the text would be emitted either way. Text produced before
`min_tokens` is reached is never searched (vLLM's behaviour: a stop cannot
end a request early).
"""

from __future__ import annotations

from typing import Optional, Sequence

from fleetserve.scheduler.sampling_params import SamplingParams

# Prompt ids kept as left context of the first window (vLLM uses 5).
_INITIAL_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], sampling_params: SamplingParams) -> None:
        self._decode_fn = _decoder(tokenizer, sampling_params.skip_special_tokens)
        # A migration continuation: the prompt's last k ids are output another replica made.
        k = sampling_params.continued_output_tokens
        prompt = list(prompt_token_ids)
        head, continued = (prompt[: len(prompt) - k], prompt[len(prompt) - k :]) if k else (prompt, [])
        self._ids: list[int] = head[-_INITIAL_CONTEXT:]
        self._prefix = 0
        self._read = len(self._ids)
        self._num_output = 0
        self._stops = [s for s in sampling_params.stop if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = sampling_params.include_stop_str_in_output
        # (min_tokens of a continuation is what is left of the original's)
        self._min_tokens = sampling_params.min_tokens + k if sampling_params.min_tokens else 0
        # A window of the decoded output: what was not handed out yet, plus
        # enough handed-out text before it for a stop string to span both.
        self._text = ""
        self._emitted = 0  # characters of _text handed out
        self._parts: list[str] = []  # everything handed out
        self._search_from = 0  # stop strings may only start at or after this index
        self.stop_string: Optional[str] = None  # the stop string that ended the request
        if continued:
            self._replay(continued)

    def _replay(self, continued: list[int]) -> None:
        """Decode the continued output as the failed replica did, and take as handed out
        what it handed out: the text it held back (the possible start of a stop string, a
        character still incomplete) comes from here, and a stop string that straddles the
        failure is matched."""
        for token_id in continued:
            self._text += self._decode_next(token_id)
            self._num_output += 1
        if self._num_output <= self._min_tokens:
            self._search_from = len(self._text)
        self._emitted = len(self._text) - self._held_back()

    @property
    def output_text(self) -> str:
        """All text handed out so far."""
        return "".join(self._parts)

    @property
    def finished(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: Sequence[int]) -> tuple[str, Optional[str]]:
        """Add sampled ids; returns (text to emit now, the stop string matched or None).

        Once a stop string matched, the request is over: later ids are ignored.
        """
        if self.finished:
            return "", None
        for token_id in new_token_ids:
            old_len = len(self._text)
            self._text += self._decode_next(token_id)
            self._num_output += 1
            if self._num_output <= self._min_tokens:
                # Text from before min_tokens may not stop the request.
                self._search_from = len(self._text)
                continue
            if self._stops and len(self._text) > old_len and self._match_stop(old_len):
                return self._release(len(self._text)), self.stop_string
        return self._release(len(self._text) - self._held_back()), None

    def flush(self) -> str:
        """At the end of the request: the text held back for a stop string that never came,
        and a last character left incomplete by the model (as U+FFFD, as a full decode shows it)."""
        if self.finished:
            return ""
        if self._read < len(self._ids):
            prefix_text = self._decode_fn(self._ids[self._prefix : self._read])
            self._text += self._decode_fn(self._ids[self._prefix :])[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        return self._release(len(self._text))

    # ---- internals -------------------------------------------------------------

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode_fn(self._ids[self._prefix : self._read])
        new_text = self._decode_fn(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing visible yet, or a character still incomplete.
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def _match_stop(self, old_len: int) -> bool:
        """Cut `_text` at the earliest stop string that ends in the new text."""
        best: Optional[tuple[int, int, str]] = None
        for stop in self._stops:
            start = max(self._search_from, old_len - len(stop) + 1, 0)
            idx = self._text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, len(stop), stop)
        if best is None:
            return False
        idx, length, stop = best
        self._text = self._text[: idx + length if self._include_stop else idx]
        self.stop_string = stop
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a stop string could start with."""
        if not self._stops or self._include_stop:
            return 0
        text = self._text
        longest = min(self._max_stop - 1, len(text) - max(self._search_from, self._emitted))
        for n in range(longest, 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        if delta:
            self._parts.append(delta)
        # Forget text no stop string can reach any more (amortized: rarely).
        drop = self._emitted - self._max_stop
        if drop > 1024:
            self._text = self._text[drop:]
            self._emitted -= drop
            self._search_from = max(self._search_from - drop, 0)
        return delta


def _decoder(tokenizer, skip_special_tokens: bool):
    """ids -> text without clean-up of spaces; the Rust tokenizer directly when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
