"""What a constrained request asks for: vLLM's `StructuredOutputsParams`.

Exactly one constraint: a JSON schema (`json`), any JSON object (`json_object`), a
regular expression, a list of choices, or an EBNF grammar (xgrammar's GBNF dialect).
This is a plain description that travels with `SamplingParams` (and so pickles across
the engine core's pipe); the engine core compiles it (replica/structured_output/).
`key()` names the compiled grammar, so equal constraints share one compilation.

Two shapes of JSON schema that xgrammar handles in time that grows faster than their size
are bounded here, before any work (a 400): counted repetitions in `pattern`s (and
`patternProperties` keys), which its schema front end converts in time quadratic in the
counts (`a{1,10000}` took seconds, on the replica's event loop, before any deadline), past
`MAX_PATTERN_REPEAT` each or `MAX_PATTERN_REPEAT_TOTAL` in all; and optional properties
(named in `properties`, not in `required`), whose compile grows much faster than their
number (2000 in one object: two minutes), past `MAX_OPTIONAL_PROPERTIES` in one object or
`MAX_OPTIONAL_PROPERTIES_TOTAL` in all. The errors a grammar's compilation ends a
request with (`GRAMMAR_ERRORS`) carry their code first, as "<code>: <message>".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Counted repetitions (`{m}`, `{m,}`, `{m,n}`) in a JSON schema's patterns: the largest
# count one may give, and the most all of a schema's counts may add up to.
MAX_PATTERN_REPEAT = 1000
MAX_PATTERN_REPEAT_TOTAL = 4000
# Optional properties: in one object, and in the whole schema.
MAX_OPTIONAL_PROPERTIES = 256
MAX_OPTIONAL_PROPERTIES_TOTAL = 1024
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # an escaped brace too: the bound errs on the safe side

# How a request whose grammar did not compile ends: finish_reason "error", and as its
# stop_reason "<code>: <message>" for one of these codes, which the HTTP layer answers with
# this status (router/replica.py).
GRAMMAR_ERRORS = {
    "grammar_compile_timeout": 400,  # its own compile ran past --structured-outputs-compile-timeout
    "grammar_compile_busy": 503,  # it waited that long for a compile worker
    "grammar_compile_failed": 500,  # xgrammar failed on a constraint that parsed
}


def grammar_error(code: str, message: str) -> str:
    """The stop_reason of a request ended by `code` (one of GRAMMAR_ERRORS)."""
    return f"{code}: {message}"


def parse_grammar_error(stop_reason: object) -> Optional[tuple[str, str]]:
    """(code, message) of a stop_reason made by `grammar_error`, else None."""
    if not isinstance(stop_reason, str):
        return None
    code, sep, message = stop_reason.partition(": ")
    return (code, message) if sep and code in GRAMMAR_ERRORS else None


@dataclass(slots=True)
class StructuredOutputsParams:
    json: Optional[Union[str, dict[str, Any]]] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    # JSON without free whitespace between tokens (vLLM's flag of the same name).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        if isinstance(self.json, dict):
            _check_patterns(self.json)
            _check_optional_properties(self.json)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): the cache key of the compiled grammar."""
        kind = self.kind
        if kind in ("json", "json_object"):
            spec = json.dumps(self.json, sort_keys=True, separators=(",", ":")) if kind == "json" else ""
            spec += f"|ws={not self.disable_any_whitespace}"
        elif kind == "choice":
            spec = json.dumps(self.choice)
        else:
            spec = getattr(self, kind)
        return kind, spec


def _nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object of a JSON schema, at any depth (subschemas, and maps of them)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            yield node
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))


def _patterns(schema: Any) -> Iterator[str]:
    """Every regular expression in a JSON schema: `pattern` values and `patternProperties` keys
    (anything else that holds a string is not a schema keyword xgrammar reads)."""
    for node in _nodes(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from (k for k in node["patternProperties"] if isinstance(k, str))


def _check_optional_properties(schema: dict[str, Any]) -> None:
    """ValueError when an object, or the whole schema, has more optional properties than
    xgrammar compiles in bounded time."""
    total = 0
    for node in _nodes(schema):
        props = node.get("properties")
        if not isinstance(props, dict):
            continue
        required = node.get("required")
        named = (
            set(required) & set(props)
            if isinstance(required, list) and all(isinstance(r, str) for r in required)
            else set()
        )
        optional = len(props) - len(named)
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise ValueError(
                f"structured_outputs.json: an object with {optional} optional properties (over "
                f"{MAX_OPTIONAL_PROPERTIES}) compiles too slowly; list them in `required` or split the object"
            )
        total += optional
    if total > MAX_OPTIONAL_PROPERTIES_TOTAL:
        raise ValueError(
            f"structured_outputs.json: the schema has {total} optional properties (over "
            f"{MAX_OPTIONAL_PROPERTIES_TOTAL}) and compiles too slowly; list them in `required`"
        )


def _check_patterns(schema: dict[str, Any]) -> None:
    """ValueError when the schema's patterns repeat more than xgrammar converts in bounded time."""
    total = 0
    for pattern in _patterns(schema):
        for m in _REPEAT.finditer(pattern):
            count = max(int(m.group(1)), int(m.group(2) or 0))
            if count > MAX_PATTERN_REPEAT:
                raise ValueError(
                    f"structured_outputs.json: the pattern repetition {m.group(0)} exceeds "
                    f"{MAX_PATTERN_REPEAT}; use maxLength/minLength or a smaller count"
                )
            total += count
    if total > MAX_PATTERN_REPEAT_TOTAL:
        raise ValueError(
            f"structured_outputs.json: the patterns' repetition counts add up to {total}, "
            f"over {MAX_PATTERN_REPEAT_TOTAL}; use maxLength/minLength or smaller counts"
        )
