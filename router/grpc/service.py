"""The `fleetserve.v1.FleetServe` gRPC service, as methods of the ingress deployment.

Ray Serve's gRPC proxy calls deployment methods named exactly like the RPCs
(`Generate` and `Chat` are server-streaming, so they are async generators of
messages). It shares the HTTP path's validation, tokenization and routing (the
ingress methods it calls are in router/ingress.py; `Chat` is validated by the
chat endpoint's own request model and shares its chat template, tool plan,
structured outputs and streaming deltas); errors map to gRPC status codes
(INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, RESOURCE_EXHAUSTED) with the
same message the HTTP API would give.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

import grpc
from google.protobuf.message import DecodeError, Message
from pydantic import ValidationError
from ray.serve.exceptions import gRPCStatusError
from ray.serve.grpc_util import RayServegRPCContext

from fleetserve.router import tracing
from fleetserve.router.api import openai_format as fmt
from fleetserve.router.api.errors import APIError, from_validation_error, is_error
from fleetserve.router.api.limits import check_sampling, check_token_lists
from fleetserve.router.api.protocol import ChatCompletionRequest
from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.health import replica_health
from fleetserve.router.tenants import NO_TENANT, TENANT_HEADER, Tenant, TenantDirectory
from fleetserve.scheduler import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from fleetserve.router.api.reasoning import ReasoningParser
    from fleetserve.router.bodies import BodyBuilder
    from fleetserve.router.engine_pools import EnginePools

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "n",
    "min_tokens",
    "truncate_prompt_tokens",
)


MAX_CLIENT_REQUEST_ID_CHARS = 256


class UndecodableRequest:
    """What a request that is not a valid message decodes to (garbage bytes, invalid UTF-8
    in a string field): the method answers INVALID_ARGUMENT instead of grpc's UNKNOWN."""

    def __init__(self, message_type: str, reason: str) -> None:
        self.message_type, self.reason = message_type, reason


def _lenient(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError) as e:
            return UndecodableRequest(message_cls.__name__, str(e) or type(e).__name__)

    return parse


def add_servicer(servicer, server) -> None:
    """`fleetserve_pb2_grpc.add_FleetServeServicer_to_server`, with request parsers that turn
    an undecodable message into `UndecodableRequest` (Serve's gRPCOptions names this)."""
    # RPC name: (grpc's handler maker, request message class, response message class)
    kinds: dict[str, tuple[Callable[..., grpc.RpcMethodHandler], type[Message], type[Message]]] = {
        "Generate": (grpc.unary_stream_rpc_method_handler, pb.GenerateRequest, pb.GenerateResponse),
        "Chat": (grpc.unary_stream_rpc_method_handler, pb.ChatRequest, pb.ChatResponse),
        "Embed": (grpc.unary_unary_rpc_method_handler, pb.EmbedRequest, pb.EmbedResponse),
        "Health": (grpc.unary_unary_rpc_method_handler, pb.HealthRequest, pb.HealthResponse),
        "ListModels": (grpc.unary_unary_rpc_method_handler, pb.ListModelsRequest, pb.ListModelsResponse),
    }
    handlers = {
        name: make(
            getattr(servicer, name), request_deserializer=_lenient(req), response_serializer=resp.SerializeToString
        )
        for name, (make, req, resp) in kinds.items()
    }
    generic = grpc.method_handlers_generic_handler("fleetserve.v1.FleetServe", handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers("fleetserve.v1.FleetServe", handlers)


def _check_decoded(request) -> None:
    if isinstance(request, UndecodableRequest):
        raise APIError(f"the request is not a valid {request.message_type} message ({request.reason})", 400)


logger = logging.getLogger("ray.serve")


class GrpcError(Exception):
    """Raised after the status is set on the context: Serve then sends that status
    (through Serve's proxy, a streaming call that yielded nothing would otherwise end
    with OK). It is the client's answer, not a failure of ours: `quiet_client_errors`
    keeps Serve from logging it as one."""


def _fail(ctx: RayServegRPCContext, status: int, message: str) -> None:
    code = _STATUS.get(status, grpc.StatusCode.INTERNAL)
    ctx.set_code(code)
    ctx.set_details(message)
    logger.info("gRPC %s: %s", code.name, message)
    raise GrpcError(message)


class _ClientErrorFilter(logging.Filter):
    """Drops Serve's records about a GrpcError (an ERROR line and a traceback each, two
    per failed call); `_fail` has already logged the one INFO line it deserves."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, gRPCStatusError):
            exc = exc.original_exception
        return not isinstance(exc, GrpcError)


_filter = _ClientErrorFilter()


def quiet_client_errors() -> None:
    """Install the filter on Serve's logger in this process (idempotent)."""
    serve_logger = logging.getLogger("ray.serve")
    if _filter not in serve_logger.filters:
        serve_logger.addFilter(_filter)


def sampling_from_proto(msg: "pb.SamplingParams", defaults: Optional[dict] = None) -> SamplingParams:
    """`defaults`: the model's generation defaults, for the fields the request leaves unset."""
    fields = {name: getattr(msg, name) for name in _SAMPLING_FIELDS if msg.HasField(name)}
    for name, value in (defaults or {}).items():
        fields.setdefault(name, min(value, 16) if name == "max_tokens" else value)
    fields.setdefault("max_tokens", 16)
    fields.update(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos)
    if msg.logit_bias:
        fields["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:
        fields["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.bad_words:
        fields["bad_words"] = list(msg.bad_words)
    if "logit_bias" in fields or "allowed_token_ids" in fields:
        fields["allowed_token_ids"] = check_token_lists(
            fields.get("logit_bias"), fields.get("allowed_token_ids"), "sampling_params."
        )
    try:
        if msg.HasField("structured_outputs"):
            fields["structured_outputs"] = _structured_from_proto(msg.structured_outputs)
        params = SamplingParams(**fields)
    except ValueError as e:
        raise APIError(f"sampling_params.{e}", 400) from e
    check_sampling(params, prefix="sampling_params.")
    return params


def _structured_from_proto(msg: "pb.StructuredOutputs") -> StructuredOutputsParams:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_outputs: set one of json, json_object, regex, choice, grammar")
    value = list(msg.choice.values) if kind == "choice" else getattr(msg, kind)
    constraint: dict[str, Any] = {kind: value}  # the one field the oneof names
    return StructuredOutputsParams(**constraint, disable_any_whitespace=msg.disable_any_whitespace)


def _json_text(text: str, param: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise APIError(f"{param} is nested too deeply", 400, param=param) from None
    except ValueError as e:
        raise APIError(f"{param} is not valid JSON: {e}", 400, param=param) from None


def _tool_call_dict(call: "pb.ToolCall") -> dict:
    return {
        "id": call.id,
        "type": call.type or "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def chat_request_from_proto(msg: "pb.ChatRequest") -> ChatCompletionRequest:
    """The `/v1/chat/completions` request a ChatRequest stands for, validated by the same
    model (so the HTTP path's checks, defaults, tool plans and constraints apply as they are);
    APIError (400) naming the field otherwise."""
    data: dict = {"model": msg.model or None, "priority": msg.priority, "messages": []}
    for m in msg.messages:
        turn: dict = {"role": m.role, "content": m.content if m.HasField("content") else None}
        if m.tool_calls:
            turn["tool_calls"] = [_tool_call_dict(c) for c in m.tool_calls]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        if m.name:
            turn["name"] = m.name
        data["messages"].append(turn)
    sp = msg.sampling_params
    if sp.HasField("logprobs"):
        raise APIError("sampling_params.logprobs: Chat does not return logprobs", 400, param="sampling_params.logprobs")
    data.update({name: getattr(sp, name) for name in _SAMPLING_FIELDS if sp.HasField(name)})
    data.update(stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos)
    if sp.logit_bias:
        data["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    if sp.allowed_token_ids:
        data["allowed_token_ids"] = list(sp.allowed_token_ids)
    if sp.bad_words:
        data["bad_words"] = list(sp.bad_words)
    if sp.HasField("structured_outputs"):
        so = sp.structured_outputs
        kind = so.WhichOneof("constraint")
        if kind is None:
            raise APIError(
                "sampling_params.structured_outputs: set one of json, json_object, regex, choice, grammar",
                400,
                param="sampling_params.structured_outputs",
            )
        data["structured_outputs"] = {
            kind: list(so.choice.values) if kind == "choice" else getattr(so, kind),
            "disable_any_whitespace": so.disable_any_whitespace,
        }
    if msg.tools:
        data["tools"] = []
        for i, tool in enumerate(msg.tools):
            fn = tool.function
            function: dict = {"name": fn.name}
            if fn.description:
                function["description"] = fn.description
            if fn.parameters:
                function["parameters"] = _json_text(fn.parameters, f"tools.{i}.function.parameters")
            if fn.HasField("strict"):
                function["strict"] = fn.strict
            data["tools"].append({"type": "function", "function": function})
    if msg.HasField("tool_choice"):
        kind = msg.tool_choice.WhichOneof("choice")
        if kind == "mode":
            data["tool_choice"] = msg.tool_choice.mode
        elif kind == "function_name":
            data["tool_choice"] = {"type": "function", "function": {"name": msg.tool_choice.function_name}}
    if msg.HasField("parallel_tool_calls"):
        data["parallel_tool_calls"] = msg.parallel_tool_calls
    if msg.HasField("response_format"):
        rf = msg.response_format
        data["response_format"] = {"type": rf.type}
        if rf.type == "json_schema":
            schema: dict[str, Any] = {"name": rf.name or None}
            if rf.schema:
                schema["schema"] = _json_text(rf.schema, "response_format.schema")
            if rf.HasField("strict"):
                schema["strict"] = rf.strict
            data["response_format"]["json_schema"] = schema
    if msg.HasField("add_generation_prompt"):
        data["add_generation_prompt"] = msg.add_generation_prompt
    if msg.continue_final_message:
        data["continue_final_message"] = True
    if msg.chat_template_kwargs:
        data["chat_template_kwargs"] = _json_text(msg.chat_template_kwargs, "chat_template_kwargs")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _chat_response(
    choice: dict, rid: str, prompt_tokens: int, completion_tokens: int, token_ids: list[int]
) -> "pb.ChatResponse":
    delta = choice["delta"]
    calls = [
        pb.ToolCall(
            index=c["index"],
            id=c.get("id", ""),
            type=c.get("type", ""),
            function=pb.FunctionCall(
                name=c.get("function", {}).get("name", ""), arguments=c.get("function", {}).get("arguments", "")
            ),
        )
        for c in delta.get("tool_calls", ())
    ]
    return pb.ChatResponse(
        request_id=rid,
        index=choice["index"],
        role=delta.get("role", ""),
        content=delta.get("content") or "",
        tool_calls=calls,
        reasoning_content=delta.get("reasoning_content") or "",
        finish_reason=choice["finish_reason"] or "",
        token_ids=token_ids,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


async def _traced(method: str, grpc_context: RayServegRPCContext, responses: AsyncIterator) -> AsyncIterator:
    """`responses` under the call's SERVER span (router/tracing.py; its metadata may carry a
    W3C `traceparent`); with tracing off, just `responses`."""
    if tracing.current() is None:
        async for response in responses:
            yield response
        return
    metadata = {str(k).lower(): str(v) for k, v in (grpc_context.invocation_metadata() or [])}
    span, token = tracing.start_request_span(
        f"fleetserve.v1.FleetServe/{method}",
        metadata,
        **{"rpc.system": "grpc", "rpc.service": "fleetserve.v1.FleetServe", "rpc.method": method},
    )
    error = None
    try:
        async for response in responses:
            yield response
    except BaseException as e:
        error = str(e) or repr(e)
        raise
    finally:
        tracing.end_request_span(span, token, error)


class GrpcMethods:
    """Mixed into the ingress class (router/ingress.py), which provides what HTTP uses too:
    `check_api_key`, `check_model`, `info`, `decode_one`, `model_ids`, `embed`,
    `served_model_name`, `reasoning`, `pools` (EnginePools: `open_stream`) and `bodies`
    (BodyBuilder)."""

    # What the ingress provides, declared here for the type checker.
    pools: EnginePools
    bodies: BodyBuilder
    served_model_name: str
    reasoning: Optional[ReasoningParser]

    if TYPE_CHECKING:

        async def info(self) -> dict: ...
        def decode_one(self, token_id: int) -> str: ...
        def model_ids(self) -> list[str]: ...
        def check_model(self, model: Optional[str]) -> None: ...
        def check_api_key(self, presented: Optional[str]) -> None: ...
        def tenant_of(self, authorization: Optional[str], claimed: Optional[str]) -> Tenant: ...
        def own(self, bodies: list[dict], tenant: Tenant) -> None: ...
        async def embed(
            self,
            inputs: list,
            add_special_tokens: bool,
            truncate_prompt_tokens: Optional[int],
            priority: int,
            model: Optional[str] = None,
            tenant: Tenant = NO_TENANT,
        ) -> tuple[list[list[float]], int]: ...

    tenants: TenantDirectory

    async def Generate(
        self, request: "pb.GenerateRequest", grpc_context: RayServegRPCContext
    ) -> AsyncIterator["pb.GenerateResponse"]:
        async for response in _traced("Generate", grpc_context, self._generate(request, grpc_context)):
            yield response

    async def _generate(
        self, request: "pb.GenerateRequest", grpc_context: RayServegRPCContext
    ) -> AsyncIterator["pb.GenerateResponse"]:
        try:
            with tracing.ingress_phase():
                tenant = self._grpc_auth(grpc_context)
                _check_decoded(request)
                body = await self._grpc_body(request)
                self.own([body], tenant)
            gen, first = await self.pools.open_stream(body)
        except APIError as e:
            _fail(grpc_context, e.status, e.body["error"]["message"])
        if is_error(first):
            _fail(grpc_context, first["status"], first["error"]["message"])
        client_id = request.request_id  # echoed back; never the engine's id (see _grpc_body)
        completion_tokens: dict[int, int] = {}
        prompt_tokens = len(body["prompt_token_ids"])
        try:
            item = first
            while True:
                if is_error(item):
                    _fail(grpc_context, item["status"], item["error"]["message"])
                for out in item["outputs"]:
                    n = completion_tokens.get(out["index"], 0) + len(out["token_ids"])
                    completion_tokens[out["index"]] = n
                    yield pb.GenerateResponse(
                        request_id=client_id or body["request_id"],
                        index=out["index"],
                        text=out["text"],
                        token_ids=out["token_ids"],
                        finish_reason=out["finish_reason"] or "",
                        prompt_tokens=prompt_tokens,
                        completion_tokens=n,
                    )
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    break
        finally:
            gen.cancel()  # a cancelled call aborts the request in the engine
            self.tenants.metrics.observe_generated(tenant.name, sum(completion_tokens.values()))

    async def Chat(
        self, request: "pb.ChatRequest", grpc_context: RayServegRPCContext
    ) -> AsyncIterator["pb.ChatResponse"]:
        """`/v1/chat/completions`, streamed as its SSE chunks are (the same ChunkWriter turns
        engine deltas into content and tool-call deltas), one message per chunk."""
        async for response in _traced("Chat", grpc_context, self._chat(request, grpc_context)):
            yield response

    async def _chat(
        self, request: "pb.ChatRequest", grpc_context: RayServegRPCContext
    ) -> AsyncIterator["pb.ChatResponse"]:
        rid = f"grpc-chat-{uuid.uuid4().hex}"
        try:
            with tracing.ingress_phase():
                tenant = self._grpc_auth(grpc_context)
                _check_decoded(request)
                if len(request.request_id) > MAX_CLIENT_REQUEST_ID_CHARS:
                    raise APIError(
                        f"request_id must be at most {MAX_CLIENT_REQUEST_ID_CHARS} characters", 400, param="request_id"
                    )
                req = chat_request_from_proto(request)
                self.check_model(req.model)
                body, _, tools = await self.bodies.chat_body(req, rid)
                self.own([body], tenant)
            gen, first = await self.pools.open_stream(body)
        except APIError as e:
            _fail(grpc_context, e.status, e.body["error"]["message"])
        if is_error(first):
            _fail(grpc_context, first["status"], first["error"]["message"])
        writer = fmt.ChunkWriter(
            rid, req.model or self.served_model_name, True, None, self.decode_one, tools, reasoning=self.reasoning
        )
        client_id = request.request_id or rid
        prompt_tokens = len(body["prompt_token_ids"])
        completion_tokens: dict[int, int] = {}
        try:
            item = first
            while True:
                if is_error(item):
                    _fail(grpc_context, item["status"], item["error"]["message"])
                token_ids = {o["index"]: o["token_ids"] for o in item["outputs"]}
                for choice in writer.choices(item):
                    idx = choice["index"]
                    completion_tokens[idx] = completion_tokens.get(idx, 0) + len(token_ids[idx])
                    yield _chat_response(choice, client_id, prompt_tokens, completion_tokens[idx], token_ids[idx])
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    break
        finally:
            gen.cancel()  # a cancelled call aborts the request in the engine
            self.tenants.metrics.observe_generated(tenant.name, sum(completion_tokens.values()))

    async def Embed(self, request: "pb.EmbedRequest", grpc_context: RayServegRPCContext) -> "pb.EmbedResponse":
        """`/v1/embeddings` (the ingress's `embed`): texts or token ids, never both."""
        try:
            tenant = self._grpc_auth(grpc_context)
            _check_decoded(request)
            self.check_model(request.model)
            if request.texts and request.token_ids:
                raise APIError("send texts or token_ids, not both", 400, param="texts")
            inputs = list(request.texts) or [list(t.ids) for t in request.token_ids]
            if not inputs or any(not i for i in inputs):
                raise APIError("every input must be non-empty, and there must be one", 400, param="texts")
            truncate = request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
            vectors, prompt_tokens = await self.embed(
                inputs, True, truncate, request.priority, request.model or None, tenant
            )
        except APIError as e:
            _fail(grpc_context, e.status, e.body["error"]["message"])
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v) for v in vectors], prompt_tokens=prompt_tokens)

    async def Health(self, request: "pb.HealthRequest", grpc_context: RayServegRPCContext) -> "pb.HealthResponse":
        report = await replica_health(self.pools)
        if not report["healthy"]:
            _fail(grpc_context, 503, f"no healthy engine replica: {report['unhealthy'] or 'none'}")
        return pb.HealthResponse(ok=True, num_replicas=len(report["healthy"]))

    async def ListModels(
        self, request: "pb.ListModelsRequest", grpc_context: RayServegRPCContext
    ) -> "pb.ListModelsResponse":
        try:
            self._grpc_auth(grpc_context)
            _check_decoded(request)
            info = await self.info()
        except APIError as e:
            _fail(grpc_context, e.status, e.body["error"]["message"])
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=name, max_model_len=info["max_model_len"]) for name in self.model_ids()]
        )

    def _grpc_auth(self, ctx: RayServegRPCContext) -> Tenant:
        """The key checked; the call's tenant (metadata `x-tenant-id`, or its key's)."""
        metadata = dict(ctx.invocation_metadata() or [])
        self.check_api_key(metadata.get("authorization"))
        return self.tenant_of(metadata.get("authorization"), metadata.get(TENANT_HEADER))

    async def _grpc_body(self, request: "pb.GenerateRequest") -> dict:
        self.check_model(request.model)
        which = request.WhichOneof("input")
        truncating = request.sampling_params.HasField("truncate_prompt_tokens")
        if which == "prompt":
            token_ids = await self.bodies.tokenize_prompt(request.prompt, True, "prompt", truncating=truncating)
        elif which == "prompt_token_ids":
            token_ids = await self.bodies.tokenize_prompt(list(request.prompt_token_ids.ids), False, "prompt_token_ids")
        else:
            raise APIError("one of prompt or prompt_token_ids is required", 400, param="prompt")
        params = sampling_from_proto(request.sampling_params, (await self.info()).get("generation_defaults"))
        explicit = request.sampling_params.max_tokens if request.sampling_params.HasField("max_tokens") else None
        token_ids = await self.bodies.truncate(token_ids, params.truncate_prompt_tokens, params.max_tokens)
        if len(request.request_id) > MAX_CLIENT_REQUEST_ID_CHARS:
            raise APIError(
                f"request_id must be at most {MAX_CLIENT_REQUEST_ID_CHARS} characters", 400, param="request_id"
            )
        # The engine's id is always ours: a client-chosen one could collide with (and then
        # abort, or be refused as a duplicate of) another client's request.
        rid = f"grpc-{uuid.uuid4().hex}"
        return await self.bodies.build_body(
            rid, token_ids, params, request.priority, None, explicit, which, request.model or None
        )
