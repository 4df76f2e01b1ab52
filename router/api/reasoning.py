"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's `<think>...</think>`
text goes to the message's `reasoning_content` (and `reasoning`), the rest to `content`.

Two parsers, with vLLM's rules:

- `deepseek_r1`: the chat template opens the thinking block itself, so the output starts
  inside it: everything up to `</think>` is reasoning (a `<think>` the model writes anyway
  is dropped), all of it when `</think>` never comes (the length ran out mid-thought).
- `qwen3`: the output thinks only when it opens with `<think>` (Qwen3 with
  `"chat_template_kwargs": {"enable_thinking": false}` does not); a whole response needs both
  tags to have reasoning, a stream turns to reasoning at `<think>` as vLLM's does.

`split` parses a whole output; `StreamSplitter` parses deltas, holding back a piece that
could be the start of a tag until the next delta says what it is, so a tag split across
deltas never leaks into either field. Tool calls are parsed from `content` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"

    @property
    def starts_inside(self) -> bool:
        """Whether the output starts inside the thinking block (the template opened it)."""
        return self.name == "deepseek_r1"

    def split(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output; None for an empty part."""
        if self.starts_inside:
            before, tag, after = text.partition(self.start)
            text = after if tag else before
            if self.end not in text:
                return text or None, None
            reasoning, _, content = text.partition(self.end)
            return reasoning or None, content or None
        if self.start not in text or self.end not in text:
            return None, text
        _, _, rest = text.partition(self.start)
        reasoning, _, content = rest.partition(self.end)
        return reasoning or None, content or None

    def streamer(self) -> "StreamSplitter":
        return StreamSplitter(self)


def get_parser(name: Optional[str]) -> Optional[ReasoningParser]:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return ReasoningParser(name)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class StreamSplitter:
    """(reasoning delta, content delta) for each text delta of one choice."""

    _OPENING, _THINKING, _CONTENT = "opening", "thinking", "content"

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = self._OPENING
        self.held = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = content = ""
        p = self.parser
        while text:
            if self.state == self._OPENING:
                head = text if p.starts_inside else text.lstrip()
                if head.startswith(p.start):
                    text, self.state = head[len(p.start) :], self._THINKING
                elif p.start.startswith(head) and not final:
                    self.held = text  # could still become the opening tag
                    break
                else:
                    self.state = self._THINKING if p.starts_inside else self._CONTENT
            elif self.state == self._THINKING:
                before, tag, after = text.partition(p.end)
                if tag:
                    reasoning += before
                    text, self.state = after, self._CONTENT
                    continue
                keep = 0 if final else _partial_suffix(text, p.end)
                reasoning += text[: len(text) - keep]
                self.held = text[len(text) - keep :]
                break
            else:
                content += text
                break
        if final and self.held:  # nothing more comes: what was held is what it looked like
            if self.state == self._THINKING:
                reasoning += self.held
            else:
                content += self.held
            self.held = ""
        return reasoning, content
