"""Engine deltas -> OpenAI response bodies (whole responses and SSE chunks).

The replica streams `{"outputs": [{"index", "text", "token_ids", "logprobs",
"finish_reason"}], "prompt_tokens"?, "finished"}` items (see router/replica.py);
this module turns them into `text_completion`, `chat.completion` and their
`.chunk` forms, with usage and logprobs in OpenAI's shapes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fleetserve.router.api.reasoning import ReasoningParser
from fleetserve.router.api.tool_calls import ToolDeltas, ToolPlan
from fleetserve.router.api.tool_calls import finish_reason as tool_finish_reason

Decode = Callable[[int], str]


def token_id_label(token_id: int) -> str:
    """vLLM's name of a token under return_tokens_as_token_ids."""
    return f"token_id:{token_id}"


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: Optional[str] = None
    echo: Optional[dict] = None  # {"token_ids", "logprobs"} of the echoed prompt (completions)
    prompt_logprobs: Optional[dict] = None  # {"logprobs", "ranks"} of its prompt, when asked


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Of cached_tokens, those whose KV a connector loaded from another engine (P/D, cluster
    # prefix reuse); reported when the router's P/D flow or a load was involved.
    remote_tokens: Optional[int] = None

    def as_dict(self) -> dict:
        details = {"cached_tokens": self.cached_tokens}
        if self.remote_tokens is not None:
            details["remote_tokens"] = self.remote_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": details,
        }


def observe(item: dict, usage: Usage) -> None:
    """Count tokens of one replica item into `usage`."""
    usage.prompt_tokens = item.get("prompt_tokens", usage.prompt_tokens)
    usage.cached_tokens = max(usage.cached_tokens, item.get("num_cached_tokens") or 0)
    if "num_remote_tokens" in item:
        usage.remote_tokens = item["num_remote_tokens"]
    for out in item["outputs"]:
        usage.completion_tokens += len(out["token_ids"])


def accumulate(choices: dict[int, Choice], item: dict) -> None:
    for out in item["outputs"]:
        c = choices.setdefault(out["index"], Choice(out["index"]))
        c.text += out["text"]
        c.token_ids.extend(out["token_ids"])
        if out.get("logprobs"):
            c.logprobs.extend(out["logprobs"])
        if out.get("finish_reason"):
            c.finish_reason = out["finish_reason"]
        if out.get("echo"):
            c.echo = out["echo"]
        if out.get("prompt_logprobs"):
            c.prompt_logprobs = out["prompt_logprobs"]


def prompt_logprobs_of(item: dict) -> Optional[dict]:
    """An engine item's prompt logprobs, as `Choice.prompt_logprobs` holds them."""
    if item.get("prompt_logprobs") is None:
        return None
    return {"logprobs": item["prompt_logprobs"], "ranks": item.get("prompt_logprob_ranks")}


def prompt_logprobs_body(
    prompt: Optional[dict], n: int, decode: Decode, label: Optional[Decode] = None
) -> Optional[list]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first: nothing predicts it) or
    {token id: {"logprob", "rank", "decoded_token"}}, the prompt's own token first, then the
    `n` likeliest (ranks 1..n)."""
    if prompt is None:
        return None
    label = label or decode
    ranks = prompt.get("ranks") or []
    out: list = []
    for i, entry in enumerate(prompt["logprobs"]):
        if entry is None:
            out.append(None)
            continue
        own = int(next(iter(entry)))  # the engine puts the prompt's token first
        rank = ranks[i] if i < len(ranks) else None
        position = {str(own): {"logprob": float(entry[next(iter(entry))]), "rank": rank, "decoded_token": label(own)}}
        for r, (t, lp) in enumerate(_top(entry, n), 1):
            position.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": label(t)})
        out.append(position)
    return out


# -- logprobs ------------------------------------------------------------------


def _top(entry: dict, n: int) -> list[tuple[int, float]]:
    ranked = sorted(((int(t), float(lp)) for t, lp in entry.items()), key=lambda x: -x[1])
    return ranked[:n]


def completion_logprobs(
    token_ids: list[int], entries: list[dict], n: int, decode: Decode, offset: int = 0, label: Optional[Decode] = None
) -> dict:
    """`label`: how tokens are named (default: their text); offsets always count text."""
    label = label or decode
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = decode(tid)
        tokens.append(label(tid))
        if entry is None:  # the first token of an echoed prompt: nothing predicts it
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(float(entry.get(tid, entry.get(str(tid), float("-inf")))))
            tops.append({label(t): lp for t, lp in _top(entry, n)} if n else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    token_ids: list[int], entries: list[dict], n: int, decode: Decode, label: Optional[Decode] = None
) -> dict:
    """`label`: how tokens are named (default: their text); `bytes` are always the text's."""
    label = label or decode
    content = []
    for tid, entry in zip(token_ids, entries):
        text = decode(tid)
        content.append(
            {
                "token": label(tid),
                "logprob": float(entry.get(tid, entry.get(str(tid), float("-inf")))),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": label(t), "logprob": lp, "bytes": list(decode(t).encode())} for t, lp in _top(entry, n)
                ],
            }
        )
    return {"content": content}


# -- bodies --------------------------------------------------------------------


def _base(rid: str, obj: str, model: str, created: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model}


def completion_body(
    rid: str,
    model: str,
    choices: dict[int, Choice],
    usage: Usage,
    logprobs_n: Optional[int],
    decode: Decode,
    label: Optional[Decode] = None,
    prompt_logprobs_n: Optional[int] = None,
) -> dict:
    body = _base(rid, "text_completion", model, int(time.time()))
    body["choices"] = []
    for c in sorted(choices.values(), key=lambda c: c.index):
        choice = {
            "index": c.index,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": (
                completion_logprobs(*_with_echo(c.echo, c.token_ids, c.logprobs), logprobs_n, decode, label=label)
                if logprobs_n is not None
                else None
            ),
        }
        if prompt_logprobs_n is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(c.prompt_logprobs, prompt_logprobs_n, decode, label)
        body["choices"].append(choice)
    body["usage"] = usage.as_dict()
    return body


def _with_echo(echo: Optional[dict], token_ids: list[int], entries: list) -> tuple[list[int], list]:
    if not echo:
        return token_ids, entries
    return echo["token_ids"] + list(token_ids), list(echo["logprobs"]) + list(entries)


def chat_body(
    rid: str,
    model: str,
    choices: dict[int, Choice],
    usage: Usage,
    logprobs_n: Optional[int],
    decode: Decode,
    tools: Optional[ToolPlan] = None,
    label: Optional[Decode] = None,
    prompt_logprobs_n: Optional[int] = None,
    reasoning: Optional[ReasoningParser] = None,
) -> dict:
    """`reasoning`: the server's reasoning parser; the message's `reasoning_content` (and its
    newer name `reasoning`) hold the thinking, `content` (and tool calls) the rest."""
    body = _base(rid, "chat.completion", model, int(time.time()))
    body["choices"] = []
    for c in sorted(choices.values(), key=lambda c: c.index):
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        text: Optional[str] = c.text
        if reasoning is not None:
            thought, text = reasoning.split(c.text)
            message.update(content=text, reasoning_content=thought, reasoning=thought)
        finish = c.finish_reason
        if tools is not None:
            message["content"], calls = tools.parse(text or "")
            if calls:
                message["tool_calls"] = calls
            finish = tool_finish_reason(finish, calls)
        body["choices"].append(
            {
                "index": c.index,
                "message": message,
                "finish_reason": finish,
                "logprobs": (
                    chat_logprobs(c.token_ids, c.logprobs, logprobs_n, decode, label)
                    if logprobs_n is not None
                    else None
                ),
            }
        )
    if prompt_logprobs_n is not None:  # vLLM's: beside the choices (one prompt)
        first = next((c.prompt_logprobs for c in choices.values() if c.prompt_logprobs), None)
        body["prompt_logprobs"] = prompt_logprobs_body(first, prompt_logprobs_n, decode, label)
    body["usage"] = usage.as_dict()
    return body


class ChunkWriter:
    """SSE chunks for one streaming request, completions or chat."""

    def __init__(
        self,
        rid: str,
        model: str,
        chat: bool,
        logprobs_n: Optional[int],
        decode: Decode,
        tools: Optional[ToolPlan] = None,
        label: Optional[Decode] = None,
        reasoning: Optional[ReasoningParser] = None,
    ) -> None:
        self.tool_deltas = ToolDeltas(tools) if tools is not None else None
        self.reasoning = reasoning if chat else None
        self._splitters: dict = {}
        self.rid, self.model, self.chat = rid, model, chat
        self.logprobs_n, self.decode, self.label = logprobs_n, decode, label
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}

    def chunks(self, item: dict, usage: Optional[Usage] = None) -> list[str]:
        """SSE chunks of one replica item; with `usage` (vLLM's continuous_usage_stats) each
        carries the usage so far."""
        out = []
        for choice in self.choices(item):
            body = self._chunk([choice])
            if usage is not None:
                body["usage"] = usage.as_dict()
            out.append(sse(body))
        return out

    def choices(self, item: dict) -> list[dict]:
        """The chunk choices (`{"index", "delta" or "text", "logprobs", "finish_reason"}`) of
        one replica item, one per output that says anything (gRPC's Chat sends these too)."""
        return [self._choice(o) for o in item["outputs"] if o["text"] or o["token_ids"] or o.get("finish_reason")]

    def usage_chunk(self, usage: Usage) -> str:
        body = self._chunk([])
        body["usage"] = usage.as_dict()
        return sse(body)

    def _chunk(self, choices: list[dict]) -> dict:
        body = _base(self.rid, self.obj, self.model, self.created)
        body["choices"] = choices
        return body

    def _choice(self, o: dict) -> dict:
        idx = o["index"]
        logprobs = None
        if self.logprobs_n is not None and (o.get("logprobs") or o.get("echo")):
            if self.chat:
                logprobs = chat_logprobs(o["token_ids"], o["logprobs"], self.logprobs_n, self.decode, self.label)
            else:
                off = self._offsets.get(idx, 0)
                logprobs = completion_logprobs(
                    *_with_echo(o.get("echo"), o["token_ids"], o["logprobs"] or []),
                    self.logprobs_n,
                    self.decode,
                    off,
                    self.label,
                )
        self._offsets[idx] = self._offsets.get(idx, 0) + len(o["text"])
        if not self.chat:
            return {"index": idx, "text": o["text"], "logprobs": logprobs, "finish_reason": o.get("finish_reason")}
        finish = o.get("finish_reason")
        text, thought = o["text"], ""
        if self.reasoning is not None:
            splitter = self._splitters.get(idx)
            if splitter is None:
                splitter = self._splitters[idx] = self.reasoning.streamer()
            thought, text = splitter.feed(o["text"], final=finish is not None)
        delta: dict[str, Any] = {"content": text}
        if self.tool_deltas is not None:
            delta, called = self.tool_deltas.delta(idx, text, finish is not None)
            finish = tool_finish_reason(finish, [True] if called else [])
        if thought:
            delta.update(reasoning_content=thought, reasoning=thought)
            if not delta.get("content"):
                delta.pop("content", None)
        if idx not in self._started:
            self._started.add(idx)
            delta["role"] = "assistant"
        return {"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
