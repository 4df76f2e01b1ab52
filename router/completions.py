"""`/v1/completions` beyond one plain prompt: prompt lists, `echo`, `suffix`.

A list of prompts becomes one engine request per prompt, all in flight at once (the
request router may place them on different replicas). `MergedStream` reads them as
one stream, in arrival order, and numbers the choices as OpenAI does: prompt i's
choice j is `index = i * n + j`. With `echo`, a choice's first chunk starts with its
prompt's text, and its logprobs with the prompt's (the first prompt token has none).

`suffix` is fill-in-the-middle: the prompt is rewritten in the PSM form of the
StarCoder family (`<fim_prefix>` prompt `<fim_suffix>` suffix `<fim_middle>`) when the
tokenizer has those tokens, and refused with a 400 otherwise.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

from fleetserve.router.errors import APIError, is_error

PromptInput = Union[str, list[int]]
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def prompt_list(prompt: Any, param: str = "prompt") -> list[PromptInput]:
    """OpenAI's four prompt shapes as a list of single prompts (string or token ids)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = list(prompt)
    else:
        raise APIError(f"{param} must not be empty", 400, param=param)
    for i, p in enumerate(prompts):
        if p == "" or p == []:
            where = param if len(prompts) == 1 else f"{param}[{i}]"
            raise APIError(f"{where} must not be empty", 400, param=param)
    return prompts


def fim_prompt(tokenizer, prompt: PromptInput, suffix: str) -> str:
    """The fill-in-the-middle prompt for `suffix`, or a 400 naming why there is none."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in FIM_TOKENS if t not in vocab]
    if missing:
        raise APIError("suffix (fill-in-the-middle) is not supported by this model: its tokenizer "
                       f"has no {', '.join(missing)} tokens", 400, param="suffix")
    if not isinstance(prompt, str):
        raise APIError("suffix needs a text prompt, not token ids", 400, param="suffix")
    prefix, middle_suffix, middle = FIM_TOKENS
    return f"{prefix}{prompt}{middle_suffix}{suffix}{middle}"


@dataclass
class Echo:
    text: str
    token_ids: list[int]


StreamOpener = Callable[[dict], Awaitable[tuple[Any, dict]]]


async def open_as_own_request(open_stream: StreamOpener, body: dict) -> tuple[Any, dict]:
    """Serve gives every call made while handling one HTTP request that request's internal
    id, and its router confuses concurrent calls that share one (they hang: seen here with
    two prompts). This task's context is its own copy, so a fresh id here names this call
    alone. (Serve's private context API: no public way to set it exists in Ray 2.60.)"""
    from ray.serve._private.utils import generate_request_id
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=generate_request_id())
    return await open_stream(body)


async def open_streams(open_stream: StreamOpener, bodies: list[dict]) -> list[tuple[Any, dict]]:
    """Open every body's stream at once; on any failure, close the others and re-raise."""
    if len(bodies) == 1:
        return [await open_stream(bodies[0])]
    tasks = [asyncio.ensure_future(open_as_own_request(open_stream, b)) for b in bodies]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                t.result()[0].cancel()
            else:
                t.cancel()
        raise


class MergedStream:
    """Streams of several prompts as one (the interface of ingress.ReplicaStream)."""

    def __init__(self, opened: list[tuple[Any, dict]], n: int, echo: Optional[list[Echo]],
                 num_prompt_tokens: int) -> None:
        self._gens = [gen for gen, _ in opened]
        self._n, self._echo = n, echo
        self._ready: collections.deque = collections.deque()
        self._tasks: dict[asyncio.Future, int] = {}
        self._seen: set[int] = set()
        self._prompt_logprobs: dict[int, list] = {}
        self._prompt_ranks: dict[int, Optional[list]] = {}
        self._cached: dict[int, int] = {}
        self._num_prompt_tokens: Optional[int] = num_prompt_tokens
        for i, (_, first) in enumerate(opened):
            self._push(i, first)

    @staticmethod
    async def open(open_stream: StreamOpener, bodies: list[dict], n: int,
                   echo: Optional[list[Echo]]) -> tuple["MergedStream", dict]:
        """(stream, first item); the first item is an error body if any prompt failed."""
        opened = await open_streams(open_stream, bodies)
        error = next((first for _, first in opened if is_error(first)), None)
        stream = MergedStream(opened, n, echo, sum(len(b["prompt_token_ids"]) for b in bodies))
        if error is not None:
            stream.cancel()
            return stream, error
        return stream, await stream.__anext__()

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        while not self._ready:
            if not self._tasks:
                raise StopAsyncIteration
            done, _ = await asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = self._tasks.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                self._push(i, item)
        return self._ready.popleft()

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        for gen in self._gens:
            gen.cancel()

    def _push(self, i: int, item: dict) -> None:
        """Queue prompt i's item, renumbered, and ask for its next one unless it finished."""
        if not is_error(item):
            item = self._renumber(i, item)
            if not item["finished"]:
                self._tasks[asyncio.ensure_future(self._gens[i].__anext__())] = i
        self._ready.append(item)

    def _renumber(self, i: int, item: dict) -> dict:
        out = {k: v for k, v in item.items()
               if k not in ("prompt_tokens", "outputs", "prompt_logprobs", "prompt_logprob_ranks")}
        if item.get("prompt_logprobs") is not None:
            self._prompt_logprobs[i] = item["prompt_logprobs"]
            self._prompt_ranks[i] = item.get("prompt_logprob_ranks")
        self._cached[i] = max(self._cached.get(i, 0), item.get("num_cached_tokens") or 0)
        out["num_cached_tokens"] = sum(self._cached.values())
        if self._num_prompt_tokens is not None:  # the usage counts every prompt, once
            out["prompt_tokens"], self._num_prompt_tokens = self._num_prompt_tokens, None
        outputs = []
        for o in item["outputs"]:
            o = dict(o, index=i * self._n + o["index"])
            if i in self._prompt_logprobs:  # each choice carries its own prompt's
                o["prompt_logprobs"] = {"logprobs": self._prompt_logprobs[i], "ranks": self._prompt_ranks[i]}
            if self._echo is not None and o["index"] not in self._seen:
                self._seen.add(o["index"])
                echo = self._echo[i]
                o["text"] = echo.text + o["text"]
                o["echo"] = {"token_ids": echo.token_ids,
                             "logprobs": self._prompt_logprobs.get(i) or [None] * len(echo.token_ids)}
            outputs.append(o)
        out["outputs"] = outputs
        return out
