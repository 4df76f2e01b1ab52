"""What a constrained request asks for: vLLM's `StructuredOutputsParams`.

Exactly one constraint: a JSON schema (`json`), any JSON object (`json_object`), a
regular expression, a list of choices, or an EBNF grammar (xgrammar's GBNF dialect).
This is a plain description that travels with `SamplingParams` (and so pickles across
the engine core's pipe); the engine core compiles it (replica/structured_output/).
`key()` names the compiled grammar, so equal constraints share one compilation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar")


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
