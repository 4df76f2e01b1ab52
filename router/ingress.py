"""The ingress deployment: OpenAI-compatible HTTP (FastAPI) and the gRPC service.

Every request is parsed and validated here (400 naming the field, 401, 404,
413 before anything reaches a replica), tokenized here (the request router
hashes the prompt's token blocks to pick a replica), then streamed from the
chosen replica through a Serve handle, chunk by chunk with no batching. The
tokenizer, model name and context length come from a replica once
(`EngineReplica.get_info`), so the ingress never loads the model itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetserve.replica.engine.chat_template import check_continue_final_message, check_template_kwargs
from fleetserve.router import auth as _auth
from fleetserve.router import cors as _cors
from fleetserve.router.api import completions
from fleetserve.router.api import openai_format as fmt
from fleetserve.router.api import embeddings as emb_api
from fleetserve.router.api import responses as resp_api
from fleetserve.router import serve_patches
from fleetserve.router.access_log import AccessLog
from fleetserve.router.auth import ApiKeyAuth, RequireApiKey
from fleetserve.router.cors import Cors, CorsSettings
from fleetserve.router.api.errors import (APIError, error_body, field_path, from_validation_error, is_error,
                                      to_response)
from fleetserve.router.feed import FEED_FLAG, FeedHub, Inbox
from fleetserve.router.grpc.service import GrpcMethods, quiet_client_errors
from fleetserve.router.routing.kv_subscriber import KVEventSubscriber
from fleetserve.router.routing.pd import PDRouter, PDSettings
from fleetserve.router.routing.prefix_reuse import PrefixReuse, ReuseSettings
from fleetserve.router.health import replica_health
from fleetserve.router.api.tool_calls import ToolDeltas
from fleetserve.router.api.limits import (FANOUT, check_internal_fields, check_prompt_chars, max_token_chars,
                                      parse_json)
from fleetserve.router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, RouterMetrics
from fleetserve.router.routing.migration import MigratingStream
from fleetserve.router.api.openapi import add_request_bodies
from fleetserve.replica.lora.request import LORA_LOAD_TIMEOUT_S
from fleetserve.router.runtime_loras import RuntimeLoRAs
from fleetserve.router.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest,
                                        sampling_dict)
from fleetserve.router.api.reasoning import get_parser as get_reasoning_parser
from fleetserve.router.routing.registry import get_router, release_request
from fleetserve.router.routing.request_router import TARGET_KWARG
from fleetserve.scheduler.sampling_params import SamplingParams, truncate_prompt

logger = logging.getLogger("ray.serve")

app = FastAPI(title="fleetserve", docs_url=None, redoc_url=None)
app.add_middleware(RequireApiKey)  # router/auth.py: every path but the open ones
app.add_middleware(AccessLog)  # outside the key check, so it logs the 401s too
app.add_middleware(Cors)  # router/cors.py: outermost, so preflights need no key

# How long a request waits for the first engine replica to answer (the model may
# still be loading) before it gets a 503 instead of hanging.
INFO_TIMEOUT_S = 10.0


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return to_response(e.body)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    param = field_path(first.get("loc", ()))
    return to_response(error_body(f"{param}: {first.get('msg')}", 400, param))


@app.exception_handler(Exception)
async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    # Not the user's fault (a replica died, an engine failed; our bug): still an OpenAI
    # body, and the one case that logs a traceback.
    logger.error("internal error: %s: %s", type(e).__name__, e, exc_info=e)
    return to_response(error_body(f"internal error: {type(e).__name__}: {e}", 500))


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    return to_response(error_body(str(e.detail), e.status_code))


class Ingress(GrpcMethods):
    def __init__(self, engine: DeploymentHandle, served_model_name: str,
                 api_key: Optional[str] = None, max_body_bytes: int = 4 << 20,
                 model_aliases: tuple[str, ...] = (), bind_host: Optional[str] = None,
                 log_requests: bool = False, reliability: Optional[dict] = None,
                 prefill: Optional[DeploymentHandle] = None,
                 pd: Optional[dict] = None, reuse: Optional[dict] = None,
                 cors: Optional[dict] = None, listed_names: tuple[str, ...] = (),
                 return_tokens_as_token_ids: bool = False,
                 reasoning_parser: Optional[str] = None,
                 lora_adapters: Optional[dict[str, str]] = None,
                 allow_runtime_lora_updating: bool = False,
                 lora_parents: Optional[dict[str, str]] = None,
                 app_name: Optional[str] = None, instance_id: Optional[str] = None) -> None:
        """`engine` is the engine pool requests stream from; with P/D (`prefill` and `pd`
        given: router.pd) it is the decode pool, and `prefill` the prefill pool."""
        # Before Serve starts this replica's own HTTP/gRPC servers (after the constructor).
        serve_patches.apply(bind_host)
        # A replacement of an ingress that failed its health checks: the old one keeps its
        # ports while Serve gives it its graceful-shutdown time to drain, then kills it.
        serve_patches.wait_for_pinned_ports(
            bind_host, (reliability or {}).get("graceful_shutdown_timeout_s", 60.0) + 30.0)
        quiet_client_errors()
        AccessLog.enabled = log_requests
        self._created = int(time.time())
        # Serve reads RAY_SERVE_USE_GRPC_BY_DEFAULT once, when ray.serve is imported, into the
        # default of every handle it builds. The engine handle was built in the driver, which
        # imports ray.serve before fleetserve exports the setting, so it arrives here set for
        # actor calls: ask for the direct gRPC channel explicitly when the setting is on here
        # (cluster.deploy puts it in this replica's runtime_env).
        if os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1":
            engine = engine.options(_by_reference=False)
            prefill = prefill.options(_by_reference=False) if prefill is not None else None
        self._engine = engine
        self._pools = [engine] + ([prefill] if prefill is not None else [])
        self._pd: Optional[PDRouter] = None
        if prefill is not None and pd is not None:
            self._pd = PDRouter(engine, prefill, PDSettings(**pd.get("settings", {})))
        self._reuse: Optional[PrefixReuse] = None
        if reuse is not None and self._pd is None:
            self._reuse = PrefixReuse(engine, ReuseSettings(**reuse.get("settings", {})))
        self._stream = engine.options(stream=True)
        self._generate = self._stream.generate  # built once: each attribute access makes a new handle
        # One Serve stream per engine replica for all requests' deltas (router.feed);
        # FLEETSERVE_STREAM_FEED=0 streams each request on its own call only.
        self._feeds = (FeedHub(self._stream)
                       if os.environ.get("FLEETSERVE_STREAM_FEED", "1") != "0" else None)
        self.served_model_name = served_model_name
        # LoRA adapters (--lora-modules, and /v1/load_lora_adapter's): a request names one in
        # `model` (name -> path; a replica that lacks it loads it from there); their KV salt
        # keys (`name@digest`, the engines' own, for prefix routing).
        self._loras = dict(lora_adapters or {})
        self._lora_parents = dict(lora_parents or {})  # --lora-modules' base_model_name, where given
        self._lora_keys: dict[str, str] = {}
        self._allow_lora_updates = allow_runtime_lora_updating
        self._lora_admin = asyncio.Lock()
        self._model_names = {served_model_name, *model_aliases, *listed_names, *self._loras}
        # Those loaded at run time, also kept in Ray's GCS for a restarted ingress (runtime_loras.py).
        self._runtime_loras: dict[str, dict] = {}
        self._lora_registry = (RuntimeLoRAs(app_name, instance_id)
                               if allow_runtime_lora_updating and app_name and instance_id else None)
        if self._lora_registry is not None:
            for name, entry in self._lora_registry.restore().items():
                if name in self._model_names:
                    continue  # a name the (same) config gives otherwise
                self._loras[name] = entry["path"]
                if entry.get("key"):
                    self._lora_keys[name] = entry["key"]
                self._model_names.add(name)
                self._runtime_loras[name] = entry
            if self._runtime_loras:
                logger.info("ingress restarted: LoRA adapters loaded at run time before, served again: %s",
                            ", ".join(sorted(self._runtime_loras)))
        self._listed_names = (served_model_name, *listed_names)  # /v1/models, in order
        self._auth = ApiKeyAuth(api_key, tuple((reliability or {}).get("open_paths", ("/health", "/ping", "/metrics"))))
        _auth.install(self._auth)
        _cors.install(CorsSettings(**cors) if cors is not None else CorsSettings())
        self._max_body_bytes = max_body_bytes
        self._tokens_as_ids = return_tokens_as_token_ids
        self._reasoning = get_reasoning_parser(reasoning_parser)  # router/reasoning.py
        self._responses = resp_api.ResponseStore()  # /v1/responses with store (router/responses.py)
        self._reliability = reliability or {}
        self._info: Optional[dict] = None
        self._info_lock = asyncio.Lock()
        self._kv_subscribers: dict[str, KVEventSubscriber] = {}
        self._metrics = RouterMetrics(self._routers, self._feeds,
                                      [flow.metrics for flow in (self._pd, self._reuse) if flow is not None])
        try:  # follow the engines' KV events from the start, not from the first request
            asyncio.get_running_loop().create_task(self._warm_up(), context=contextvars.Context())
        except RuntimeError:
            pass  # no loop yet: the first request starts it

    # -- shared plumbing (HTTP and gRPC) ---------------------------------------

    async def info(self) -> dict:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        infos = [await asyncio.wait_for(pool.get_info.remote(), INFO_TIMEOUT_S)
                                 for pool in self._pools]  # each builds this process's router
                    except asyncio.TimeoutError:
                        raise APIError("the model is still loading (no engine replica has "
                                       "answered yet); retry shortly", 503) from None
                    for pool, pool_info in zip(self._pools, infos):
                        self._set_pool_hashing(pool, pool_info)
                    info = infos[0]
                    for part in (self._pd, self._reuse):  # the decode (or only) pool's blocks
                        if part is not None and "block_size" in info:
                            part.block_size = int(info["block_size"])
                    if info.get("tokenizer") is not None:  # every real engine has one
                        info["max_token_chars"] = max_token_chars(info["tokenizer"])
                    for name, key in (info.get("lora_keys") or {}).items():
                        self._lora_keys.setdefault(name, key)
                    self._info = info
                    self._start_kv_subscribers()
        return self._info

    async def _warm_up(self) -> None:
        try:
            await self.info()
        except Exception as e:  # noqa: BLE001 - replicas not up yet: the first request retries
            logger.info("ingress warm-up: replicas not reachable yet: %r", e)

    def _set_pool_hashing(self, pool, pool_info: dict) -> None:
        """Prefix routing hashes prompts as the pool's engines hash their KV blocks (block
        size and `prefix_caching_hash_algo` from their info, not from a second setting):
        any other hash never matches what their KV events report."""
        router = get_router(pool.app_name, pool.deployment_name)
        policy = getattr(router, "policy", None)
        if policy is not None and "block_size" in pool_info:
            policy.set_hashing(pool_info["block_size"], pool_info.get("hash_algo", "builtin"))

    def _start_kv_subscribers(self) -> None:
        """Feed each pool's routing policy's KV index (precise prefix routing) with its
        replicas' KV events, when the policy has one (router.kv_subscriber)."""
        for pool in self._pools:
            router = get_router(pool.app_name, pool.deployment_name)
            index = getattr(getattr(router, "policy", None), "kv_index", None)
            if index is not None and pool.deployment_name not in self._kv_subscribers:
                sub = KVEventSubscriber(pool, router.replica_ids, index)
                self._kv_subscribers[pool.deployment_name] = sub
                sub.start()

    def decode_one(self, token_id: int) -> str:
        return self._info["tokenizer"].decode([token_id])

    def token_label(self, req) -> Optional[fmt.Decode]:
        """How logprobs name tokens: vLLM's `token_id:<id>` when the server or the request
        asks (`return_tokens_as_token_ids`), else None (their text)."""
        if self._tokens_as_ids or getattr(req, "return_tokens_as_token_ids", False):
            return fmt.token_id_label
        return None

    def check_model(self, model: Optional[str]) -> None:
        if model and model not in self._model_names:
            raise APIError(f"The model `{model}` does not exist; this server serves "
                           + ", ".join(f"`{n}`" for n in self._listed_names)
                           + (" and the LoRA adapters " + ", ".join(f"`{n}`" for n in self._loras)
                              if self._loras else ""), 404, param="model",
                           code="model_not_found")

    def check_api_key(self, presented: Optional[str]) -> None:
        self._auth.check(presented)

    async def tokenize_prompt(self, prompt: Union[str, list[int]], add_special_tokens: bool,
                              param: str, truncating: bool = False) -> list[int]:
        """`truncating`: the request keeps only the prompt's last tokens, so a prompt longer
        than the context is fine (the body size limit still bounds the work)."""
        info = await self.info()
        tok = info["tokenizer"]
        if isinstance(prompt, str):
            if "max_token_chars" in info and not truncating:
                check_prompt_chars(prompt, info["max_model_len"], info["max_token_chars"], param)
            return tok(prompt, add_special_tokens=add_special_tokens).input_ids
        vocab = len(tok)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"{param} contains token ids outside the vocabulary [0, {vocab})",
                           400, param=param)
        return list(prompt)

    async def truncate(self, token_ids: list[int], k: Optional[int],
                       max_tokens: Optional[int]) -> list[int]:
        """The prompt as `truncate_prompt_tokens` keeps it (vLLM's: its last tokens)."""
        if k is None:
            return token_ids
        try:
            return truncate_prompt(token_ids, k, (await self.info())["max_model_len"], max_tokens)
        except ValueError as e:
            raise APIError(str(e), 400, param="truncate_prompt_tokens") from None

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool,
                                  tools: Optional[list[dict]] = None,
                                  template_kwargs: Optional[dict] = None,
                                  continue_final_message: bool = False) -> str:
        tok = (await self.info())["tokenizer"]
        try:
            extra = check_template_kwargs(template_kwargs)
        except ValueError as e:
            raise APIError(str(e), 400, param="chat_template_kwargs") from None
        try:
            check_continue_final_message(add_generation_prompt, continue_final_message)
        except ValueError as e:
            raise APIError(str(e), 400, param="continue_final_message") from None
        if continue_final_message:
            extra["continue_final_message"] = True
        try:
            return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # jinja errors, missing template: the messages are at fault
            raise APIError(f"messages could not be rendered with the chat template: {e}", 400,
                           param="messages") from e

    async def build_body(self, request_id: str, token_ids: list[int], params, priority: int,
                         cache_salt: Optional[str], explicit_max_tokens: Optional[int],
                         param: str, model: Optional[str] = None) -> dict:
        """The engine body of one prompt; `model` (the request's) picks a LoRA adapter when it
        names one."""
        max_len = (await self.info())["max_model_len"]
        if not token_ids:
            raise APIError(f"{param} must not be empty", 400, param=param)
        if len(token_ids) >= max_len:
            raise APIError(f"This model's maximum context length is {max_len} tokens. However, "
                           f"your prompt has {len(token_ids)} tokens; shorten the {param}.",
                           400, param=param, code="context_length_exceeded")
        if explicit_max_tokens is not None and len(token_ids) + explicit_max_tokens > max_len:
            raise APIError(f"This model's maximum context length is {max_len} tokens. However, you "
                           f"requested {len(token_ids) + explicit_max_tokens} tokens "
                           f"({len(token_ids)} in the prompt, {explicit_max_tokens} for the "
                           "completion); reduce max_tokens or the prompt.",
                           400, param="max_tokens", code="context_length_exceeded")
        # Truncated here, once: a migrated or handed-off request resends its prompt plus
        # what it generated, which the engine must not cut again.
        sampling = dict(sampling_dict(params), truncate_prompt_tokens=None)
        body = {"request_id": request_id, "prompt_token_ids": token_ids,
                "sampling_params": sampling, "priority": priority,
                "cache_salt": cache_salt}
        if model in self._loras:
            body["lora_name"] = model
            if model in self._lora_keys:  # what the routers salt prefix hashes with, as the engine
                body["lora_key"] = self._lora_keys[model]
            # A replica without it (started after a run-time load, or it evicted the adapter:
            # --max-cpu-loras) loads it from there first.
            body["lora_path"] = self._loras[model]
        return body

    async def open_stream(self, body: dict):
        """Send to a replica; return (generator, first item). The first item may be an error."""
        if self._pd is not None:
            await self.info()  # the pools' routers exist: the P/D flow picks from them
            return await self._pd.open_stream(body, self._open_call)
        if self._reuse is not None:
            await self.info()
            return await self._reuse.open_stream(body, self._open_call, self._open_plain)
        return await self._open_plain(body)

    def _open_call(self, generate, body: dict, **kwargs) -> "ReplicaStream":
        """Call an engine pool's streaming `generate` (this ingress's pool handle, or the P/D
        and reuse flows' pinned ones: the same deployment) with the per-step feed."""
        return ReplicaStream.open(generate, body, self._feeds, **kwargs)

    async def _open_plain(self, body: dict):
        gen = MigratingStream(lambda b: self._open_call(self._generate, b), body,
                              max_migrations=self._reliability.get("max_migrations", 2))
        try:
            first = await gen.__anext__()
        except BackPressureError:  # Serve's bounded queue in front of the replicas is full
            first = error_body("the server is overloaded; retry later", 429)
        except BaseException:
            gen.cancel()
            raise
        if is_error(first):
            gen.cancel()
        return gen, first

    async def replica_calls(self, op: str, timeout_s: float = 10.0, **kwargs) -> dict[str, dict]:
        """`op` on every replica this ingress routes to: replica id -> result.

        One at a time on purpose: Serve gives every child call of one incoming
        request the same internal request id, and its router mixes up
        concurrent calls that share one (they hang).
        """
        await self.info()  # makes sure the handle's router exists and knows the replicas
        results = {}
        for pool in self._pools:  # the engine pool; with P/D, the prefill pool too
            router = get_router(pool.app_name, pool.deployment_name)
            for rid in (router.replica_ids() if router else []):
                call = pool.control.remote(op, **kwargs, **{TARGET_KWARG: rid})
                r = await asyncio.wait_for(call, timeout_s)
                results[r["replica"]] = r
        return results

    # -- HTTP: generation ------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        self.check_model(req.model)
        prompts = completions.prompt_list(req.prompt)
        if req.suffix is not None:
            tok = (await self.info())["tokenizer"]
            prompts = [completions.fim_prompt(tok, p, req.suffix) for p in prompts]
        defaults = (await self.info()).get("generation_defaults")
        params = req.sampling_params(default_max_tokens=16, defaults=defaults)
        rid = f"cmpl-{uuid.uuid4().hex}"
        bodies = []
        for i, prompt in enumerate(prompts):
            token_ids = await self.tokenize_prompt(prompt, True, "prompt",
                                                   truncating=req.truncate_prompt_tokens is not None)
            token_ids = await self.truncate(token_ids, req.truncate_prompt_tokens, req.max_tokens)
            bodies.append(await self.build_body(rid if len(prompts) == 1 else f"{rid}-{i}", token_ids,
                                                params, req.priority, req.cache_salt, req.max_tokens,
                                                "prompt", req.model))
        if len(bodies) == 1 and not req.echo:
            return await self._respond(bodies[0], req, chat=False, logprobs_n=req.logprobs)
        echo = None
        if req.echo:
            tok = (await self.info())["tokenizer"]
            echo = [completions.Echo(p if isinstance(p, str) and req.truncate_prompt_tokens is None
                                     else tok.decode(b["prompt_token_ids"]),
                                     b["prompt_token_ids"]) for p, b in zip(prompts, bodies)]
        gen, first = await completions.MergedStream.open(self.open_stream, bodies, params.n, echo, FANOUT)
        return await self._respond_with(gen, first, rid, req, chat=False, logprobs_n=req.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        body, params, tools = await self.chat_body(req, f"chatcmpl-{uuid.uuid4().hex}")
        return await self._respond(body, req, chat=True, logprobs_n=params.logprobs, tools=tools)

    async def chat_body(self, req: ChatCompletionRequest, rid: str):
        """(engine body, sampling params, tool plan or None) of a chat request: the chat
        template with the tools, the sampling params with the model's defaults, a forced
        tool call's grammar. `/v1/chat/completions` and gRPC's Chat share it."""
        self.check_model(req.model)
        tools = req.tool_plan()
        text = await self.apply_chat_template([m.flat() for m in req.messages],
                                              req.add_generation_prompt,
                                              tools.template_tools() if tools else None,
                                              req.chat_template_kwargs, req.continue_final_message)
        token_ids = await self.tokenize_prompt(text, False, "messages",
                                               truncating=req.truncate_prompt_tokens is not None)
        token_ids = await self.truncate(token_ids, req.truncate_prompt_tokens, req._max_tokens())
        info = await self.info()
        params = req.sampling_params(default_max_tokens=max(1, info["max_model_len"] - len(token_ids)),
                                     defaults=info.get("generation_defaults"))
        if tools is not None and tools.mode != "auto":
            if params.structured_outputs is not None:
                raise APIError("a forced tool_choice cannot be combined with another structured "
                               "output constraint", 400, param="tool_choice")
            params = params.replace(structured_outputs=tools.structured_outputs())
        body = await self.build_body(rid, token_ids, params, req.priority, req.cache_salt,
                                     req._max_tokens(), "messages", req.model)
        return body, params, tools

    async def _respond(self, body: dict, req, chat: bool, logprobs_n: Optional[int], tools=None):
        gen, first = await self.open_stream(body)
        return await self._respond_with(gen, first, body["request_id"], req, chat, logprobs_n, tools)

    async def _respond_with(self, gen, first: dict, rid: str, req, chat: bool,
                            logprobs_n: Optional[int], tools=None):
        if is_error(first):
            return to_response(first)
        model = req.model or self.served_model_name
        if req.stream:
            writer = fmt.ChunkWriter(rid, model, chat, logprobs_n, self.decode_one, tools,
                                     label=self.token_label(req), reasoning=self._reasoning)
            return StreamingResponse(self._sse(gen, first, writer, req.include_usage, req.continuous_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        choices: dict[int, fmt.Choice] = {}
        usage = fmt.Usage()
        prompt_lp = None  # one prompt's, on the item (a merged stream puts them on each choice)

        def take(item: dict) -> None:
            nonlocal prompt_lp
            fmt.accumulate(choices, item)
            fmt.observe(item, usage)
            prompt_lp = fmt.prompt_logprobs_of(item) or prompt_lp

        error = await drain(gen, first, take)
        if error is not None:
            return to_response(error)
        label = self.token_label(req)
        prompt_n = getattr(req, "prompt_logprobs", None)
        if prompt_lp is not None:
            for c in choices.values():
                c.prompt_logprobs = c.prompt_logprobs or prompt_lp
        if chat:
            return JSONResponse(fmt.chat_body(rid, model, choices, usage, logprobs_n, self.decode_one, tools,
                                              label=label, prompt_logprobs_n=prompt_n,
                                              reasoning=self._reasoning))
        return JSONResponse(fmt.completion_body(rid, model, choices, usage, logprobs_n, self.decode_one,
                                                label=label, prompt_logprobs_n=prompt_n))

    async def _sse(self, gen, first: dict, writer: fmt.ChunkWriter,
                   include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        usage = fmt.Usage()
        try:
            async for item in stream_items(gen, first):
                if is_error(item):
                    yield fmt.sse({"error": item["error"]})
                    break
                fmt.observe(item, usage)
                for chunk in writer.chunks(item, usage if continuous_usage else None):
                    yield chunk
            if include_usage:
                yield writer.usage_chunk(usage)
            yield fmt.SSE_DONE
        finally:
            # Client gone (this generator cancelled/closed) or done: cancelling the
            # handle's stream cancels the replica's generator, which aborts the
            # request in the engine and frees its KV blocks.
            gen.cancel()

    # -- HTTP: OpenAI's Responses API (router/responses.py) ----------------------

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        req = await self._parse(request, resp_api.ResponsesRequest)
        self.check_model(req.model)
        history: list[dict] = []
        if req.previous_response_id is not None:
            _, history = self._responses.get(req.previous_response_id, param="previous_response_id")
        chat = req.to_chat(history)
        rid, stem = resp_api.new_ids()
        try:
            body, _, tools = await self.chat_body(chat, rid)
        except APIError as e:
            return to_response(resp_api.in_responses_terms(e.body))
        gen, first = await self.open_stream(body)
        if is_error(first):
            return to_response(resp_api.in_responses_terms(first))
        run = _ResponseRun(self, req, rid, stem, history + req.input_messages(), tools)
        if req.stream:
            return StreamingResponse(run.events(gen, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        error = await drain(gen, first, run.observe)
        return to_response(error) if error is not None else JSONResponse(run.result())

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request):
        self.check_api_key(request.headers.get("authorization"))
        return self._responses.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        self.check_api_key(request.headers.get("authorization"))
        self._responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # -- HTTP: OpenAI's embeddings API (router/embeddings.py) ---------------------

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        req = await self._parse(request, emb_api.EmbeddingRequest)
        self.check_model(req.model)
        if req.dimensions is not None and req.dimensions < 1:
            raise APIError(f"dimensions must be positive, got {req.dimensions}", 400, param="dimensions")
        width = (await self.info()).get("hidden_size") if req.dimensions is not None else None
        if width and req.dimensions != width:  # refused before any input is computed
            raise APIError(f"this model's embeddings have {width} dimensions; reducing them "
                           "(dimensions) is not supported", 400, param="dimensions")
        vectors, prompt_tokens = await self.embed(completions.prompt_list(req.input, "input"),
                                                  req.add_special_tokens, req.truncate_prompt_tokens,
                                                  req.priority, req.model)
        if req.dimensions is not None and req.dimensions != len(vectors[0]):
            raise APIError(f"this model's embeddings have {len(vectors[0])} dimensions; reducing them "
                           "(dimensions) is not supported", 400, param="dimensions")
        return JSONResponse(emb_api.response_body(req.model or self.served_model_name, vectors,
                                                  req.encoding_format, prompt_tokens))

    # -- HTTP: vLLM's score and rerank APIs, by embedding similarity (router/embeddings.py) --

    @app.post("/v1/score")
    @app.post("/score", include_in_schema=False)  # (aliases, as vLLM serves them)
    async def score(self, request: Request):
        req = await self._parse(request, emb_api.ScoreRequest)
        self.check_model(req.model)
        try:
            pairs = req.pairs()
        except ValueError as e:
            raise APIError(str(e), 400, param="text_2") from None
        scores, tokens = await self._similarities(pairs, req)
        return JSONResponse(emb_api.score_body(f"score-{uuid.uuid4().hex}", int(time.time()),
                                               req.model or self.served_model_name, scores, tokens))

    @app.post("/v1/rerank")
    @app.post("/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    async def rerank(self, request: Request):
        req = await self._parse(request, emb_api.RerankRequest)
        self.check_model(req.model)
        if not req.documents:
            raise APIError("documents must hold at least one document", 400, param="documents")
        if req.top_n < 0:
            raise APIError(f"top_n must be 0 (every document) or more, got {req.top_n}", 400, param="top_n")
        scores, tokens = await self._similarities([(req.query, d) for d in req.documents], req)
        return JSONResponse(emb_api.rerank_body(f"rerank-{uuid.uuid4().hex}", req.model or self.served_model_name,
                                                req, scores, tokens))

    async def _similarities(self, pairs: list[tuple[str, str]], req) -> tuple[list[float], int]:
        """Each pair's cosine similarity, every distinct text embedded once; and the tokens read."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors, tokens = await self.embed(texts, req.add_special_tokens, req.truncate_prompt_tokens,
                                           req.priority, req.model)
        by_text = dict(zip(texts, vectors))
        return [emb_api.cosine(by_text[a], by_text[b]) for a, b in pairs], tokens

    async def embed(self, inputs: list, add_special_tokens: bool, truncate_prompt_tokens: Optional[int],
                    priority: int, model: Optional[str] = None) -> tuple[list[list[float]], int]:
        """(one vector per input, the inputs' tokens) for `/v1/embeddings` and gRPC's Embed:
        each input a request of its own (max_tokens=1, embed), at most `FANOUT` of them
        in flight; the first error, as an APIError."""
        if len(inputs) > emb_api.MAX_INPUTS:
            raise APIError(f"input may hold at most {emb_api.MAX_INPUTS} items, got {len(inputs)}",
                           400, param="input")
        params = SamplingParams(max_tokens=1, temperature=0.0, embed=True)
        rid = f"embd-{uuid.uuid4().hex}"
        bodies = []
        for i, prompt in enumerate(inputs):
            token_ids = await self.tokenize_prompt(prompt, add_special_tokens, "input",
                                                   truncating=truncate_prompt_tokens is not None)
            token_ids = await self.truncate(token_ids, truncate_prompt_tokens, 1)
            bodies.append(await self.build_body(f"{rid}-{i}", token_ids, params, priority, None, None, "input",
                                                model))
        gate = asyncio.Semaphore(FANOUT)

        async def one(body: dict) -> list[float]:
            async with gate:  # (each input its own Serve request: concurrent calls sharing one hang)
                gen, first = await completions.open_as_own_request(self.open_stream, body)
                got: list = []
                error = await drain(gen, first, lambda item: got.append(item["embedding"])
                                    if "embedding" in item else None)
            if error is not None:
                e = error["error"]
                raise APIError(e["message"], error.get("status", 500), param=e.get("param"), code=e.get("code"))
            if not got:
                raise APIError("the engine finished an input without its embedding", 500)
            return got[0]

        tasks = [asyncio.ensure_future(one(b)) for b in bodies]
        try:
            # The first failure ends the request: the other inputs are aborted, not finished.
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
            if failed:
                raise failed[0]
            vectors = [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
        return vectors, sum(len(b["prompt_token_ids"]) for b in bodies)

    # -- HTTP: the rest --------------------------------------------------------

    # -- HTTP: LoRA adapters at run time (vLLM's endpoints) ----------------------------

    def _check_lora_updates(self) -> None:
        if not self._allow_lora_updates:
            raise APIError("loading and unloading LoRA adapters at run time is off; start the server "
                           "with --enable-lora --allow-runtime-lora-updating", 404)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request):
        """Load an adapter on every engine replica (both pools with P/D); a replica that starts
        later loads it with the first request for it. 400 naming the problem, after unloading
        it from the replicas that had taken it, when any replica cannot load it."""
        req = await self._parse(request, LoadLoRAAdapterRequest)
        self._check_lora_updates()
        name, path = req.lora_name, req.lora_path
        async with self._lora_admin:
            if name in self._model_names:
                what = "LoRA adapter" if name in self._loras else "model name"
                raise APIError(f"The {what} '{name}' is already in use; unload it first or pick "
                               "another name", 400, param="lora_name")
            # replace: a replica's copy under a name this ingress does not serve is left over
            # (from an ingress of an earlier config, which forgot it): the new weights win.
            results = await self.replica_calls("load_lora", timeout_s=LORA_LOAD_TIMEOUT_S + 10, name=name, path=path,
                                               replace=True)
            if not results:
                raise APIError("no engine replica is running to load the adapter on", 503)
            failed = [r for r in results.values() if "error" in r]
            if failed:
                await self.replica_calls("unload_lora", name=name)
                busy = [r for r in failed if r.get("status") == 429]
                raise APIError(f"LoRA adapter '{name}' could not be loaded: {(busy or failed)[0]['error']}",
                               429 if busy else 400, param="lora_path")
            keys = {r["key"] for r in results.values()}
            if len(keys) > 1:
                logger.warning("LoRA adapter %r: the replicas read different files at %s (%s)", name, path, keys)
            self._loras[name] = path
            self._lora_keys[name] = min(keys)
            self._model_names.add(name)
            self._runtime_loras[name] = {"path": path, "key": min(keys)}
            await self._save_runtime_loras()
        logger.info("LoRA adapter %r loaded from %s on %d replicas", name, path, len(results))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    def __del__(self) -> None:
        """Serve's graceful stop of this replica (app deleted or redeployed, `fleetserve serve`
        ending): the adapters loaded at run time go with it. A crash runs no destructor, and
        the ingress Serve starts in its place takes them back."""
        registry = getattr(self, "_lora_registry", None)
        if registry is not None and self._runtime_loras:
            registry.drop()

    async def _save_runtime_loras(self) -> None:
        if self._lora_registry is not None:  # (under _lora_admin: saves land in order)
            await asyncio.to_thread(self._lora_registry.save, dict(self._runtime_loras))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request):
        """Stop serving an adapter: new requests naming it get a 404 at once; requests running
        with it finish with it, then each replica frees its weights."""
        req = await self._parse(request, UnloadLoRAAdapterRequest)
        self._check_lora_updates()
        name = req.lora_name
        async with self._lora_admin:
            if name not in self._loras:
                raise APIError(f"The LoRA adapter '{name}' cannot be found.", 404, param="lora_name",
                               code="model_not_found")
            del self._loras[name]
            self._lora_parents.pop(name, None)
            self._lora_keys.pop(name, None)
            self._model_names.discard(name)
            if self._runtime_loras.pop(name, None) is not None:
                await self._save_runtime_loras()
            await self.replica_calls("unload_lora", name=name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/v1/models")
    async def models(self, request: Request):
        self.check_api_key(request.headers.get("authorization"))
        info = await self.info()
        return {"object": "list", "data": [self._model_card(name, info)
                                           for name in (*self._listed_names, *self._loras)]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        """OpenAI's retrieve-model (`client.models.retrieve(name)`): the card, or a 404."""
        self.check_api_key(request.headers.get("authorization"))
        if model not in self._model_names:
            self.check_model(model)
        return self._model_card(model, await self.info())

    def _model_card(self, name: str, info: dict) -> dict:
        if name in self._loras:  # vLLM's card of an adapter: its path, and the base model as parent
            return {"id": name, "object": "model", "created": self._created, "owned_by": "fleetserve",
                    "root": self._loras[name], "parent": self._lora_parents.get(name, self.served_model_name),
                    "max_model_len": info["max_model_len"]}
        return {"id": name, "object": "model", "created": self._created, "owned_by": "fleetserve",
                "root": info["model_name"], "max_model_len": info["max_model_len"]}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(self):
        """vLLM's (and SageMaker's) liveness path: /health's answer, open like it."""
        return await self.health()

    @app.get("/version")
    async def version(self):
        from fleetserve import __version__

        return {"version": __version__}

    @app.get("/health")
    async def health(self):
        report = await replica_health(self)  # router/health.py: engines asked, not actors
        if not report["healthy"]:
            return to_response(error_body(
                f"no healthy engine replica: {report['unhealthy'] or 'none running'}", 503))
        body = {"status": "ok" if not report["unhealthy"] else "degraded",
                "num_replicas": len(report["healthy"]), "unhealthy": report["unhealthy"]}
        prefill = report.get("prefill")
        if prefill is not None:  # P/D: the decode pool above, the prefill pool here
            body["prefill"] = {"num_replicas": len(prefill["healthy"]),
                               "unhealthy": prefill["unhealthy"]}
            if prefill["unhealthy"] or not prefill["healthy"]:
                body["status"] = "degraded"  # prompts are recomputed on the decode side
        return body

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        req = await self._parse(request, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", 400, param="prompt")
        if req.messages is not None:
            text = await self.apply_chat_template([m.flat() for m in req.messages],
                                                  req.add_generation_prompt,
                                                  template_kwargs=req.chat_template_kwargs,
                                                  continue_final_message=req.continue_final_message)
            ids = await self.tokenize_prompt(text, False, "messages")
        else:
            ids = await self.tokenize_prompt(req.prompt, req.add_special_tokens, "prompt")
        info = await self.info()
        return {"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        req = await self._parse(request, DetokenizeRequest)
        self.check_model(req.model)
        ids = await self.tokenize_prompt(req.tokens, False, "tokens")
        return {"prompt": (await self.info())["tokenizer"].decode(ids)}

    @app.get("/metrics")
    async def metrics(self):
        try:
            results = await self.replica_calls("metrics_text")
        except Exception as e:  # a replica is down or slow: say so, don't 500
            return to_response(error_body(f"replicas unreachable: {e!r}", 503))
        return PlainTextResponse(self._metrics.exposition({rid: r["text"] for rid, r in results.items()}),
                                 media_type=METRICS_CONTENT_TYPE)

    def _routers(self) -> list[tuple[str, Any]]:
        """(deployment name, request router) of each engine pool whose router exists."""
        found = [(p.deployment_name, get_router(p.app_name, p.deployment_name)) for p in self._pools]
        return [(name, router) for name, router in found if router is not None]

    # -- request parsing -------------------------------------------------------

    async def _parse(self, request: Request, model: type[BaseModel]):
        self.check_api_key(request.headers.get("authorization"))
        data = parse_json(await self._read_body(request))
        if not isinstance(data, dict):
            raise APIError("the request body must be a JSON object", 400)
        check_internal_fields(data)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise from_validation_error(e) from e

    async def _read_body(self, request: Request) -> bytes:
        """The body, within the size limit (413) and the time limit (408: a client that sent
        fewer bytes than its Content-Length would otherwise hold the connection forever)."""
        timeout_s = self._reliability.get("body_timeout_s", 30.0)
        try:
            return await asyncio.wait_for(self._read_body_unbounded(request), timeout_s)
        except asyncio.TimeoutError:
            raise APIError(f"the request body did not arrive within {timeout_s:g} s", 408,
                           code="request_timeout") from None

    async def _read_body_unbounded(self, request: Request) -> bytes:
        limit = self._max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(f"the request body is larger than {limit} bytes", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(f"the request body is larger than {limit} bytes", 413)
            chunks.append(chunk)
        return b"".join(chunks)


async def drain(gen, first: dict, take) -> Optional[dict]:
    """`take` each item, `first` on, to the stream's end; the error item that ended it, if one
    did. The stream is cancelled on the way out (a no-op when it finished; an abort in the
    engine when this request was cancelled)."""
    try:
        item = first
        while not is_error(item):
            take(item)
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                return None
        return item
    finally:
        gen.cancel()


async def stream_items(gen, first: dict) -> AsyncIterator[dict]:
    """`first`, then the stream's items up to its end or an error item; a replica that fails
    mid-stream ends it with a 500 error item (the client is told, not cut off)."""
    item = first
    while True:
        yield item
        if is_error(item):
            return
        try:
            item = await gen.__anext__()
        except StopAsyncIteration:
            return
        except Exception as e:  # noqa: BLE001 - reported to the client as the stream's end
            item = error_body(f"internal error: {type(e).__name__}: {e}", 500)


class _ResponseRun:
    """One /v1/responses request's output: text, tool calls, usage, finish, and its stored
    conversation."""

    def __init__(self, ingress: "Ingress", req, rid: str, stem: str, conversation: list[dict],
                 tools=None) -> None:
        self.ingress, self.req, self.rid, self.stem = ingress, req, rid, stem
        self.tools = tools  # the chat request's ToolPlan, or None
        self.model = req.model or ingress.served_model_name
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
            parser = self.ingress._reasoning
            thought, text = parser.split(whole) if parser else (None, whole)
            calls: list[dict] = []
            if self.tools is not None and text is not None:
                text, calls = self.tools.parse(text)
            out = resp_api.Output(thought, text, tuple(calls))
        u = self.usage
        response = resp_api.response_object(
            self.rid, self.stem, self.req, self.model, self.created, out, self.finish,
            resp_api.usage_of(u.prompt_tokens, u.completion_tokens, u.cached_tokens))
        if self.req.store:
            answer = {"role": "assistant", "content": out.text or ""}
            if out.calls:
                answer["tool_calls"] = [dict(c) for c in out.calls]
            self.ingress._responses.put(response, self.conversation + [answer])
        return response

    async def events(self, gen, first: dict) -> AsyncIterator[str]:
        writer = resp_api.EventWriter(self.rid, self.stem)
        parser = self.ingress._reasoning
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
            started = resp_api.response_object(self.rid, self.stem, self.req, self.model, self.created,
                                               None, None, None, status="in_progress")
            for event in writer.start(started):
                yield event
            async for item in stream_items(gen, first):
                if is_error(item):
                    error = item["error"]
                    code = "rate_limit_exceeded" if item.get("status") == 429 else "server_error"
                    failed = resp_api.response_object(
                        self.rid, self.stem, self.req, self.model, self.created, None, None, None,
                        status="failed", error={"code": code, "message": error["message"]})
                    for event in writer.fail(failed, error):
                        yield event
                    return
                for piece in self.observe(item):
                    for event in pieces(piece, False):
                        yield event
            for event in pieces("", True):  # what the splitter and the tool parser held back
                yield event
            response = self.result(resp_api.Output(thought or None, writer.message_text or None,
                                                   tuple(writer.calls)))
            for event in writer.finish(response):
                yield event
        finally:
            gen.cancel()  # client gone or done: aborts the request in the engine if it runs


class ReplicaStream:
    """A replica's `generate` stream, one delta at a time. The replica sends a list
    when several deltas were ready at once (router.replica.ready_batches); they are
    handed out here without awaiting in between, so their SSE chunks also leave in one
    ASGI message.

    With a `FeedHub` (router.feed) the call carries a feed key: when the replica marks an
    item (`"feed": True`: the replica has our feed open), the later items come from the
    hub's feed into this stream's inbox, and a task of ours waits on the call itself (its
    end, its failure, or items it still sends if the feed closed). Until then, and without
    a hub, everything comes on the call as before; a first item from a replica that has no
    feed from us opens one (the replica moves this request onto it once it is open)."""

    def __init__(self, gen, hub: Optional[FeedHub] = None, key: Optional[int] = None,
                 inbox: Optional[Inbox] = None) -> None:
        self._gen = gen
        self._ready: collections.deque = collections.deque()
        self._hub, self._key, self._inbox = hub, key, inbox
        self._watcher: Optional[asyncio.Task] = None
        self._first = True
        self._done = False

    @classmethod
    def open(cls, generate, body: dict, hub: Optional[FeedHub], **kwargs) -> "ReplicaStream":
        if hub is None:
            return cls(generate.remote(body, **kwargs))
        call, key, inbox = hub.open(generate, body, **kwargs)
        return cls(call, hub, key, inbox)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._ready:
            return self._ready.popleft()
        if self._watcher is not None:  # the feed brings the items
            if self._done:
                raise StopAsyncIteration
            try:
                item = await self._inbox.get()
            except BaseException:
                self._finish()
                raise
            if isinstance(item, dict) and (item.get("finished") or is_error(item)):
                self._finish()
            return item
        try:
            item = await self._gen.__anext__()
        except BaseException:  # the end, an error, or our caller cancelled: stop counting it
            self._finish()
            raise
        if self._hub is not None:
            last = item[-1] if isinstance(item, list) else item
            if isinstance(last, dict) and last.pop(FEED_FLAG, False):
                # The rest comes over the feed (already arriving in our inbox, in order).
                self._watcher = asyncio.ensure_future(self._watch())
                self._hub.bind(self._key, last.get("replica", ""))
            elif self._first and not is_error(last):
                self._hub.ensure(last.get("replica", ""))  # no feed there yet: open one
            self._first = False
        if isinstance(item, list):
            self._ready.extend(item[1:])
            item = item[0]
        if self._watcher is None and isinstance(item, dict) and (
                item.get("finished") or is_error(item)) and not self._ready:
            self._finish()
        return item

    async def _watch(self) -> None:
        """The call itself, while the feed brings the items: its end, its failure, or items
        it sends once the feed closed on the replica."""
        try:
            async for payload in self._gen:
                self._inbox.put(payload)
            self._inbox.end()
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - raised to the reader (migration decides)
            self._inbox.fail(e)

    def cancel(self) -> None:
        self._gen.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        self._finish()

    def _finish(self) -> None:
        # After a last item the watcher stays: the call ends right after it on the replica.
        if self._done:
            return
        self._done = True
        self._forget_key()
        meta = getattr(self._gen, "_request_metadata", None)
        if meta is not None:
            release_request(meta.internal_request_id)

    def _forget_key(self) -> None:
        if self._hub is not None and self._key is not None:
            self._hub.forget(self._key)
            self._key = None


# /openapi.json describes the bodies the routes parse themselves (router/openapi.py).
add_request_bodies(app, {"/v1/completions": CompletionRequest,
                         "/v1/chat/completions": ChatCompletionRequest,
                         "/v1/responses": resp_api.ResponsesRequest,
                         "/v1/embeddings": emb_api.EmbeddingRequest,
                         "/v1/score": emb_api.ScoreRequest, "/v1/rerank": emb_api.RerankRequest,
                         "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
IngressDeployment = serve.ingress(app)(Ingress)
