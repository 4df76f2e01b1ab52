"""`/v1/completions` beyond one plain prompt: prompt lists, `echo`, `suffix`.

A list of prompts becomes one engine request per prompt, at most `limits.FANOUT` in
flight at once (the request router may place them on different replicas). `MergedStream` reads them as
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
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

from fleetserve.router.api.errors import APIError, is_error
from fleetserve.router.api.limits import check_prompt_count

PromptInput = Union[str, list[int]]
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def prompt_list(prompt: Any, param: str = "prompt") -> list[PromptInput]:
    """OpenAI's four prompt shapes as a list of single prompts (string or token ids); at most
    `limits.MAX_PROMPTS` of them (CompletionRequest refuses more before validating them)."""
    prompts: list[PromptInput]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = list(prompt)
        check_prompt_count(len(prompts), param)
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
        raise APIError(
            "suffix (fill-in-the-middle) is not supported by this model: its tokenizer "
            f"has no {', '.join(missing)} tokens",
            400,
            param="suffix",
        )
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
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=str(uuid.uuid4()))
    return await open_stream(body)


class MergedStream:
    """Streams of several prompts as one (the interface of ingress.ReplicaStream).

    At most `window` prompts are in flight at once (limits.FANOUT): the next opens when one
    finishes, so a request of hundreds of prompts holds a bounded share of the replicas'
    queues and of this loop, as any `window` single requests would. The first `window` open
    before the stream starts, so a refusal there (a 429) is the request's answer; a later
    prompt's refusal ends the stream with its error."""

    def __init__(
        self, open_stream: StreamOpener, bodies: list[dict], n: int, echo: Optional[list[Echo]], window: int
    ) -> None:
        self._open_stream = open_stream
        self._pending = collections.deque(enumerate(bodies))
        self._gens: dict[int, Any] = {}
        self._n, self._echo = n, echo
        self._ready: collections.deque = collections.deque()
        self._tasks: dict[asyncio.Future, int] = {}  # a prompt's next item, or its stream's opening
        self._seen: set[int] = set()
        self._prompt_logprobs: dict[int, list] = {}
        self._prompt_ranks: dict[int, Optional[list]] = {}
        self._cached: dict[int, int] = {}
        self._num_prompt_tokens: Optional[int] = sum(len(b["prompt_token_ids"]) for b in bodies)

    @staticmethod
    async def open(
        open_stream: StreamOpener, bodies: list[dict], n: int, echo: Optional[list[Echo]], window: int
    ) -> tuple["MergedStream", dict]:
        """(stream, first item); the first item is an error body if a first prompt failed."""
        stream = MergedStream(open_stream, bodies, n, echo, window)
        first: list[tuple[int, asyncio.Future[tuple[Any, dict]]]] = []
        while stream._pending and len(first) < window:
            i, body = stream._pending.popleft()
            first.append((i, asyncio.ensure_future(open_as_own_request(open_stream, body))))
        try:
            opened = await asyncio.gather(*(task for _, task in first))
        except BaseException:
            for _, task in first:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[0].cancel()
                else:
                    task.cancel()
            raise
        for (i, _), (gen, _) in zip(first, opened):
            stream._gens[i] = gen
        error = next((item for _, item in opened if is_error(item)), None)
        if error is not None:
            stream.cancel()
            return stream, error
        for (i, _), (_, item) in zip(first, opened):
            stream._push(i, item)
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
                    result = task.result()
                except StopAsyncIteration:
                    self._open_next()
                    continue
                if i not in self._gens:  # an opening: (stream, its first item)
                    self._gens[i], result = result
                self._push(i, result)
        return self._ready.popleft()

    def cancel(self) -> None:
        self._pending.clear()
        for task, i in self._tasks.items():
            if i not in self._gens and task.done() and not task.cancelled() and task.exception() is None:
                task.result()[0].cancel()  # opened, not yet read: its engine request is live
            else:
                task.cancel()
        self._tasks.clear()
        for gen in self._gens.values():
            gen.cancel()

    def _open_next(self) -> None:
        if self._pending:
            i, body = self._pending.popleft()
            self._tasks[asyncio.ensure_future(open_as_own_request(self._open_stream, body))] = i

    def _push(self, i: int, item: dict) -> None:
        """Queue prompt i's item, renumbered, and ask for its next one (or, once it finished,
        open the next prompt)."""
        if is_error(item):
            self._pending.clear()  # the stream ends here: open nothing more
        else:
            item = self._renumber(i, item)
            if item["finished"]:
                self._open_next()
            else:
                self._tasks[asyncio.ensure_future(self._gens[i].__anext__())] = i
        self._ready.append(item)

    def _renumber(self, i: int, item: dict) -> dict:
        out = {
            k: v
            for k, v in item.items()
            if k not in ("prompt_tokens", "outputs", "prompt_logprobs", "prompt_logprob_ranks")
        }
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
                o["echo"] = {
                    "token_ids": echo.token_ids,
                    "logprobs": self._prompt_logprobs.get(i) or [None] * len(echo.token_ids),
                }
            outputs.append(o)
        out["outputs"] = outputs
        return out
