"""xgrammar, the grammar engine behind structured outputs.

Three verbs: `check` parses a constraint without a tokenizer (cheap: the front end
calls it so that a bad schema, regex or grammar is a 400 before anything is queued);
`XgrammarBackend.compile` builds the token-level automaton for one tokenizer (the
expensive part, run on the manager's thread pool); `Matcher` follows one request's
output tokens and fills its row of the step's token bitmask.

JSON schemas are compiled with xgrammar's strict mode (as vLLM does), so an object
has only the properties its schema names unless it says otherwise; OpenAI's
`strict` flag is accepted and the schema is always enforced in full.
"""

from __future__ import annotations

import json
import re
from typing import Optional

import torch

from fleetserve.scheduler.structured_outputs import StructuredOutputsParams


def _xgr():
    import xgrammar

    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`.

    Text goes in as UTF-8, not as \\u escapes: xgrammar 0.2.8 reads hex digits after \\u
    greedily ("\\u00e9a" became U+0E9A; found by the choice tests). A control character
    is a literal of its own, so nothing can follow its escape."""

    def literal(text: str) -> str:
        parts: list[str] = []
        run: list[str] = []
        for ch in text:
            if ord(ch) < 0x20 or ch == "\x7f":
                if run:
                    parts.append('"' + "".join(run) + '"')
                    run = []
                parts.append(f'"\\x{ord(ch):02x}"')
            else:
                run.append("\\" + ch if ch in '"\\' else ch)
        if run:
            parts.append('"' + "".join(run) + '"')
        return "(" + " ".join(parts) + ")"

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _source(params: StructuredOutputsParams):
    """What xgrammar compiles for a constraint: EBNF text, or a Grammar from its own front end
    (parsed now, so a bad constraint raises here). Non-ASCII text must reach the compiler as
    EBNF text: `compile_grammar(Grammar)` in xgrammar 0.2.8 goes through the printer, whose
    \\x escapes come back as other characters (see _unescape_non_ascii)."""
    xgr = _xgr()
    kind = params.kind
    if kind == "json":
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(params.json), any_whitespace=not params.disable_any_whitespace
        )
        return _json_ebnf(grammar)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return _unescape_non_ascii(str(xgr.Grammar.from_regex(params.regex)))
    text = choice_ebnf(params.choice) if params.choice is not None else params.grammar
    if text is None:
        raise ValueError(f"structured output of kind {kind!r} gives no choice and no grammar")
    xgr.Grammar.from_ebnf(text)  # raises on a bad grammar
    return text


# xgrammar 0.2.8 writes the characters of a length-bounded string (maxLength/minLength) as
# `[^"\\\r\n]`, which lets raw control characters (U+0000-U+001F) into a JSON string, where
# JSON forbids them (found by tests/replica/test_structured_outputs.py: byte 0x10 came out).
# Its plain strings exclude them; give bounded strings the same class.
_LOOSE_CHARS = r"[^\"\\\r\n]"
_JSON_CHARS = r"[^\0-\x1f\"\\\r\n]"


# A \\x, \\u or \\U escape the printer wrote (not an escaped backslash before an "x").
_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def _unescape_non_ascii(text: str) -> str:
    """The printer writes non-ASCII as \\xHH / \\uHHHH, and the parser reads hex digits
    greedily ("\\xe9" + "a" comes back as U+0E9A): put those characters back as UTF-8."""

    def sub(m: re.Match) -> str:
        code = int(m.group(2) or m.group(3) or m.group(4), 16)
        return m.group(0) if code < 0x80 else m.group(1) + chr(code)

    return _ESCAPE.sub(sub, text)


def _json_ebnf(grammar) -> str:
    """A JSON schema's grammar as EBNF text, with bounded strings fixed (above)."""
    return _unescape_non_ascii(str(grammar).replace(_LOOSE_CHARS, _JSON_CHARS))


def check(params: StructuredOutputsParams) -> None:
    """ValueError naming the constraint when xgrammar cannot parse it."""
    try:
        _source(params)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
        message = str(e).split("] ", 1)[-1].strip() if "] " in str(e) else str(e)
        raise ValueError(f"structured_outputs.{params.kind}: invalid {_NAMES[params.kind]}: {message}") from None


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


class XgrammarBackend:
    """Compiles constraints for one tokenizer; thread-safe (xgrammar's compiler is)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: Optional[int], max_threads: int = 2) -> None:
        xgr = _xgr()
        stop = [eos_token_id] if eos_token_id is not None else None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)

    def compile(self, params: StructuredOutputsParams):
        return self.compiler.compile_grammar(_source(params))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return _xgr().allocate_token_bitmask(rows, self.vocab_size)


class Matcher:
    """One request's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, compiled) -> None:
        self._m = _xgr().GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()
