"""The `fleetserve.v1.FleetServe` gRPC service, as methods of the ingress deployment.

Ray Serve's gRPC proxy calls deployment methods named exactly like the RPCs
(`Generate` is server-streaming, so it is an async generator of messages). It
shares the HTTP path's validation, tokenization and routing (the ingress
methods it calls are in router/ingress.py); errors map to gRPC status codes
(INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, RESOURCE_EXHAUSTED) with the
same message the HTTP API would give.
"""

from __future__ import annotations

import logging
import uuid
from typing import AsyncIterator, Optional

import grpc
from ray.serve.exceptions import gRPCStatusError
from ray.serve.grpc_util import RayServegRPCContext

from fleetserve.router.errors import APIError, is_error
from fleetserve.router.proto import fleetserve_pb2 as pb
from fleetserve.scheduler import SamplingParams, StructuredOutputsParams

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "logprobs", "n", "min_tokens")


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
    fields.update(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                  ignore_eos=msg.ignore_eos)
    if msg.logit_bias:
        fields["logit_bias"] = dict(msg.logit_bias)
    try:
        if msg.HasField("structured_outputs"):
            fields["structured_outputs"] = _structured_from_proto(msg.structured_outputs)
        return SamplingParams(**fields)
    except ValueError as e:
        raise APIError(f"sampling_params.{e}", 400) from e


def _structured_from_proto(msg: "pb.StructuredOutputs") -> StructuredOutputsParams:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_outputs: set one of json, json_object, regex, choice, grammar")
    value = list(msg.choice.values) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputsParams(**{kind: value, "disable_any_whitespace": msg.disable_any_whitespace})


class GrpcMethods:
    """Mixed into the ingress class (which provides check_model, tokenize_prompt, ...)."""

    async def Generate(self, request: "pb.GenerateRequest",
                       grpc_context: RayServegRPCContext) -> AsyncIterator["pb.GenerateResponse"]:
        try:
            self._grpc_auth(grpc_context)
            body = await self._grpc_body(request)
            gen, first = await self.open_stream(body)
        except APIError as e:
            _fail(grpc_context, e.status, e.body["error"]["message"])
        if is_error(first):
            _fail(grpc_context, first["status"], first["error"]["message"])
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
                        request_id=body["request_id"], index=out["index"], text=out["text"],
                        token_ids=out["token_ids"], finish_reason=out["finish_reason"] or "",
                        prompt_tokens=prompt_tokens, completion_tokens=n)
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    break
        finally:
            gen.cancel()  # a cancelled call aborts the request in the engine

    async def Health(self, request: "pb.HealthRequest",
                     grpc_context: RayServegRPCContext) -> "pb.HealthResponse":
        try:
            loads = await self.replica_calls("get_load", timeout_s=5.0)
        except Exception as e:  # replicas unreachable: report, don't crash the call
            _fail(grpc_context, 503, f"replicas unreachable: {e!r}")
        return pb.HealthResponse(ok=True, num_replicas=len(loads))

    async def ListModels(self, request: "pb.ListModelsRequest",
                         grpc_context: RayServegRPCContext) -> "pb.ListModelsResponse":
        try:
            self._grpc_auth(grpc_context)
            info = await self.info()
        except APIError as e:
            _fail(grpc_context, e.status, e.body["error"]["message"])
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=self.served_model_name, max_model_len=info["max_model_len"])])

    def _grpc_auth(self, ctx: RayServegRPCContext) -> None:
        metadata = dict(ctx.invocation_metadata() or [])
        self.check_api_key(metadata.get("authorization"))

    async def _grpc_body(self, request: "pb.GenerateRequest") -> dict:
        self.check_model(request.model)
        which = request.WhichOneof("input")
        if which == "prompt":
            token_ids = await self.tokenize_prompt(request.prompt, True, "prompt")
        elif which == "prompt_token_ids":
            token_ids = await self.tokenize_prompt(list(request.prompt_token_ids.ids), False,
                                                   "prompt_token_ids")
        else:
            raise APIError("one of prompt or prompt_token_ids is required", 400, param="prompt")
        params = sampling_from_proto(request.sampling_params,
                                     (await self.info()).get("generation_defaults"))
        explicit = (request.sampling_params.max_tokens
                    if request.sampling_params.HasField("max_tokens") else None)
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        return await self.build_body(rid, token_ids, params, request.priority, None, explicit,
                                     which)
