"""One /v1/responses request run against an engine stream (router/api/responses.py has the
API's request, objects and events): the whole response, or its stream of events, each with
the reasoning parser's and the tool plan's reading of the output, stored when asked."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from fleetserve.router.api import openai_format as fmt
from fleetserve.router.api import responses as resp_api
from fleetserve.router.api.errors import is_error
from fleetserve.router.api.tool_calls import ToolDeltas
from fleetserve.router.streams import stream_items


class ResponseRun:
    """One /v1/responses request's output: text, tool calls, usage, finish, and its stored
    conversation. `model`: the name the response reports; `reasoning`: the server's reasoning
    parser, or None; `store`: where a response with `store` set is kept."""

    def __init__(
        self,
        req,
        rid: str,
        stem: str,
        conversation: list[dict],
        model: str,
        store: resp_api.ResponseStore,
        reasoning=None,
        tools=None,
    ) -> None:
        self.req, self.rid, self.stem = req, rid, stem
        self.tools = tools  # the chat request's ToolPlan, or None
        self.model = model
        self.reasoning, self.store = reasoning, store
        self.created = resp_api.now()
        self.conversation = conversation
        self.usage = fmt.Usage()
        self.parts: list[str] = []
        self.finish: Optional[str] = None

    def observe(self, item: dict) -> list[str]:
        """Count one replica item; its new text pieces."""
        fmt.observe(item, self.usage)
        new = []
        for out in item["outputs"]:
            if out["text"]:
                new.append(out["text"])
            if out.get("finish_reason"):
                self.finish = out["finish_reason"]
        self.parts.extend(new)
        return new

    def result(self, streamed: Optional[resp_api.Output] = None) -> dict:
        """The response (stored when asked). `streamed`: the output as the stream sent it;
        else the reasoning parser's and the tool plan's reading of the whole output."""
        out = streamed
        if out is None:
            whole = "".join(self.parts)
            parser = self.reasoning
            thought, text = parser.split(whole) if parser else (None, whole)
            calls: list[dict] = []
            if self.tools is not None and text is not None:
                text, calls = self.tools.parse(text)
            out = resp_api.Output(thought, text, tuple(calls))
        u = self.usage
        response = resp_api.response_object(
            self.rid,
            self.stem,
            self.req,
            self.model,
            self.created,
            out,
            self.finish,
            resp_api.usage_of(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
        )
        if self.req.store:
            answer: dict[str, Any] = {"role": "assistant", "content": out.text or ""}
            if out.calls:
                answer["tool_calls"] = [dict(c) for c in out.calls]
            if not self.store.put(response, self.conversation + [answer]):
                response["store"] = False  # over the store's byte bound on its own: not kept
        return response

    async def events(self, gen, first: dict) -> AsyncIterator[str]:
        writer = resp_api.EventWriter(self.rid, self.stem)
        parser = self.reasoning
        splitter = parser.streamer() if parser is not None else None
        tool_deltas = ToolDeltas(self.tools) if self.tools is not None else None
        thought = ""

        def content(piece: str, final: bool) -> list[str]:
            if tool_deltas is None:
                return writer.delta(piece) if piece else []
            delta, _ = tool_deltas.delta(0, piece, final)
            events = writer.delta(delta["content"]) if delta.get("content") else []
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    events += writer.call_start(call["id"], call["function"]["name"])
                if call["function"].get("arguments"):
                    events += writer.call_arguments(call["function"]["arguments"])
            return events

        def pieces(piece: str, final: bool) -> list[str]:
            nonlocal thought
            if splitter is None:
                return content(piece, final)
            r, c = splitter.feed(piece, final)
            thought += r
            # (no content yet: a named call's header waits for its first argument text)
            return (writer.reasoning_delta(r) if r else []) + (content(c, final) if c or final else [])

        try:
            started = resp_api.response_object(
                self.rid, self.stem, self.req, self.model, self.created, None, None, None, status="in_progress"
            )
            for event in writer.start(started):
                yield event
            async for item in stream_items(gen, first):
                if is_error(item):
                    error = item["error"]
                    code = "rate_limit_exceeded" if item.get("status") == 429 else "server_error"
                    failed = resp_api.response_object(
                        self.rid,
                        self.stem,
                        self.req,
                        self.model,
                        self.created,
                        None,
                        None,
                        None,
                        status="failed",
                        error={"code": code, "message": error["message"]},
                    )
                    for event in writer.fail(failed, error):
                        yield event
                    return
                for piece in self.observe(item):
                    for event in pieces(piece, False):
                        yield event
            for event in pieces("", True):  # what the splitter and the tool parser held back
                yield event
            response = self.result(resp_api.Output(thought or None, writer.message_text or None, tuple(writer.calls)))
            for event in writer.finish(response):
                yield event
        finally:
            gen.cancel()  # client gone or done: aborts the request in the engine if it runs
