"""The ingress deployment: the OpenAI-compatible HTTP routes (FastAPI) and the gRPC service.

Every request is parsed and validated here (400 naming the field, 401, 404, 413 before
anything reaches a replica), turned into engine bodies (router/bodies.py: tokenized here,
so the request router hashes the prompt's token blocks to pick a replica), then streamed
from the chosen replica through a Serve handle, chunk by chunk with no batching
(router/engine_pools.py; router/streams.py). The tokenizer, model name and context length
come from a replica once (`EngineReplica.get_info`), so the ingress never loads the model.

What the routes delegate:
    router/settings.py      IngressSettings: what the deployment is built with (cluster/deploy.py)
    router/engine_pools.py  the engine deployments: info, P/D and reuse flows, migration, the feed
    router/bodies.py        API request -> engine bodies
    router/loras.py         LoRA adapters by name, loaded and unloaded at run time
    router/metrics.py       /metrics: the replicas' reported metrics merged, and the router's own
    router/api/             the API's models, bodies, chunks, errors and limits
    router/grpc/service.py  the gRPC methods, mixed into this class
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetserve.router import auth as _auth
from fleetserve.router import cors as _cors
from fleetserve.router import serve_patches, tracing
from fleetserve.router.access_log import AccessLog
from fleetserve.router.api import completions
from fleetserve.router.api import embeddings as emb_api
from fleetserve.router.api import openai_format as fmt
from fleetserve.router.api import responses as resp_api
from fleetserve.router.api.errors import APIError, error_body, field_path, from_validation_error, is_error, to_response
from fleetserve.router.api.limits import FANOUT, check_internal_fields, parse_json
from fleetserve.router.api.openapi import add_request_bodies
from fleetserve.router.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from fleetserve.router.api.reasoning import get_parser as get_reasoning_parser
from fleetserve.router.api.response_run import ResponseRun
from fleetserve.router.auth import ApiKeyAuth, RequireApiKey
from fleetserve.router.bodies import BodyBuilder
from fleetserve.router.cors import Cors
from fleetserve.router.engine_pools import EnginePools
from fleetserve.router.grpc.service import GrpcMethods, quiet_client_errors
from fleetserve.router.health import replica_health
from fleetserve.router.loras import LoRAAdmin
from fleetserve.router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fleetserve.router.metrics import RouterMetrics
from fleetserve.router.settings import IngressSettings
from fleetserve.router.streams import drain, stream_items
from fleetserve.router.tenants import NO_TENANT, TENANT_HEADER, Tenant, TenantDirectory, stamp
from fleetserve.router.tracing import TraceRequests

logger = logging.getLogger("ray.serve")

app = FastAPI(title="fleetserve", docs_url=None, redoc_url=None)
app.add_middleware(RequireApiKey)  # router/auth.py: every path but the open ones
app.add_middleware(AccessLog)  # outside the key check, so it logs the 401s too
app.add_middleware(TraceRequests)  # router/tracing.py: a request's span (a 401 too)
app.add_middleware(Cors)  # router/cors.py: outermost, so preflights need no key

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    def __init__(
        self, engine: DeploymentHandle, settings: IngressSettings, prefill: Optional[DeploymentHandle] = None
    ) -> None:
        """`engine` is the engine pool requests stream from; with P/D (`prefill` given and
        `settings.pd` set: router/routing/pd.py) it is the decode pool, and `prefill` the
        prefill pool."""
        # Before Serve starts this replica's own HTTP/gRPC servers (after the constructor).
        serve_patches.apply(settings.bind_host)
        # A replacement of an ingress that failed its health checks: the old one keeps its
        # ports while Serve gives it its graceful-shutdown time to drain, then kills it.
        serve_patches.wait_for_pinned_ports(settings.bind_host, settings.graceful_shutdown_timeout_s + 30.0)
        quiet_client_errors()
        AccessLog.enabled = settings.log_requests
        self.settings = settings
        self.served_model_name = settings.served_model_name
        self._created = int(time.time())
        self._served = settings.served_names
        self.loras = LoRAAdmin(settings.lora, reserved=self._served)
        self.pools = EnginePools(engine, settings, prefill, on_info=self.loras.learn_keys)
        self.bodies = BodyBuilder(self.pools, self.loras)
        self.tenants = TenantDirectory(settings.tenants)  # router/tenants.py
        self._metrics = RouterMetrics(
            self.pools.routers,
            self.pools.feeds,
            [
                *(flow.metrics for flow in self.pools.flows()),
                self.tenants.metrics,
                *([self.pools.slo_metrics] if self.pools.slo_metrics is not None else []),
            ],
        )
        self._auth = ApiKeyAuth(
            settings.api_key,
            settings.open_paths,
            admin_key=settings.lora.admin_key,
            tenant_digests=self.tenants.digests,
        )
        if tracing.setup(settings.tracing, role="ingress") is not None:
            self._metrics.registry.register(tracing.EXPORTS.collector("fleetserve:router_trace_spans"))
        _auth.install(self._auth)
        _cors.install(settings.cors)
        self.reasoning = get_reasoning_parser(settings.reasoning_parser)  # router/api/reasoning.py
        self._responses = resp_api.ResponseStore()  # /v1/responses with store (router/api/responses.py)
        self.pools.warm_up_soon()

    def __del__(self) -> None:
        """Serve's graceful stop of this replica (app deleted or redeployed, `fleetserve serve`
        ending): the adapters loaded at run time go with it (router/loras.py)."""
        loras = getattr(self, "loras", None)
        if loras is not None:
            loras.close()

    # -- shared by HTTP and gRPC ------------------------------------------------

    async def info(self) -> dict:
        return await self.pools.info()

    def decode_one(self, token_id: int) -> str:
        return self.pools.tokenizer.decode([token_id])

    def token_label(self, req) -> Optional[fmt.Decode]:
        """How logprobs name tokens: vLLM's `token_id:<id>` when the server or the request
        asks (`return_tokens_as_token_ids`), else None (their text)."""
        if self.settings.return_tokens_as_token_ids or getattr(req, "return_tokens_as_token_ids", False):
            return fmt.token_id_label
        return None

    def model_ids(self) -> list[str]:
        """What /v1/models (and gRPC's ListModels) lists, in order: the served names, then
        the LoRA adapters."""
        return [self.served_model_name, *self.settings.listed_names, *self.loras.names()]

    def check_model(self, model: Optional[str]) -> None:
        if model and model not in self._served and model not in self.loras:
            adapters = self.loras.names()
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                + ", ".join(f"`{n}`" for n in (self.served_model_name, *self.settings.listed_names))
                + (" and the LoRA adapters " + ", ".join(f"`{n}`" for n in adapters) if adapters else ""),
                404,
                param="model",
                code="model_not_found",
            )

    def check_api_key(self, presented: Optional[str]) -> None:
        self._auth.check(presented)

    def tenant_of(self, authorization: Optional[str], claimed: Optional[str]) -> Tenant:
        """The request's tenant (router/tenants.py): its key's, else `x-tenant-id`'s."""
        return self.tenants.identify(authorization, claimed)

    def own(self, bodies: list[dict], tenant: Tenant) -> None:
        """Stamp one API request's engine bodies as `tenant`'s, and count it."""
        for body in bodies:
            stamp(body, tenant)
        self.tenants.metrics.observe_request(tenant.name, sum(len(b["prompt_token_ids"]) for b in bodies))

    def _http_tenant(self, request: Request) -> Tenant:
        tenant = self.tenant_of(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))
        request.state.tenant = tenant.name  # for the access log line (router/access_log.py)
        return tenant

    async def embed(
        self,
        inputs: list,
        add_special_tokens: bool,
        truncate_prompt_tokens: Optional[int],
        priority: int,
        model: Optional[str] = None,
        tenant: Tenant = NO_TENANT,
    ) -> tuple[list[list[float]], int]:
        """(one vector per input, the inputs' tokens) for `/v1/embeddings` and gRPC's Embed:
        each input a request of its own (router/api/embeddings.py: at most `FANOUT` in flight)."""
        emb_api.check_input_count(inputs)
        bodies = await self.bodies.embedding_bodies(
            f"embd-{uuid.uuid4().hex}", inputs, add_special_tokens, truncate_prompt_tokens, priority, model
        )
        self.own(bodies, tenant)
        vectors = await emb_api.embed_all(self.pools.open_stream, bodies)
        return vectors, sum(len(b["prompt_token_ids"]) for b in bodies)

    # -- HTTP: generation ------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        with tracing.ingress_phase():
            req = await self._parse(request, CompletionRequest)
            self.check_model(req.model)
            rid = f"cmpl-{uuid.uuid4().hex}"
            prompts, bodies, params = await self.bodies.completion_bodies(req, rid)
            tenant = self._http_tenant(request)
            self.own(bodies, tenant)
        if len(bodies) == 1 and not req.echo:
            return await self._respond(bodies[0], req, chat=False, logprobs_n=req.logprobs)
        echo = None
        if req.echo:
            tok = (await self.info())["tokenizer"]
            echo = [
                completions.Echo(
                    p
                    if isinstance(p, str) and req.truncate_prompt_tokens is None
                    else tok.decode(b["prompt_token_ids"]),
                    b["prompt_token_ids"],
                )
                for p, b in zip(prompts, bodies)
            ]
        gen, first = await completions.MergedStream.open(self.pools.open_stream, bodies, params.n, echo, FANOUT)
        return await self._respond_with(gen, first, rid, req, chat=False, logprobs_n=req.logprobs, tenant=tenant.name)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        with tracing.ingress_phase():
            req = await self._parse(request, ChatCompletionRequest)
            self.check_model(req.model)
            body, params, tools = await self.bodies.chat_body(req, f"chatcmpl-{uuid.uuid4().hex}")
            self.own([body], self._http_tenant(request))
        return await self._respond(body, req, chat=True, logprobs_n=params.logprobs, tools=tools)

    async def _respond(self, body: dict, req, chat: bool, logprobs_n: Optional[int], tools=None):
        start = time.monotonic()
        gen, first = await self.pools.open_stream(body)
        slo = None
        if self.pools.slo is not None and not is_error(first):
            # Judged for the goodput metrics: TTFT from here to the first item, TPOT to the end.
            slo = _SloClock(self.pools, body.get("tenant"), start, time.monotonic())
        return await self._respond_with(
            gen, first, body["request_id"], req, chat, logprobs_n, tools, body.get("tenant"), slo
        )

    async def _respond_with(
        self,
        gen,
        first: dict,
        rid: str,
        req,
        chat: bool,
        logprobs_n: Optional[int],
        tools=None,
        tenant: Optional[str] = None,
        slo: Optional["_SloClock"] = None,
    ):
        if is_error(first):
            return to_response(first)
        model = req.model or self.served_model_name
        if req.stream:
            writer = fmt.ChunkWriter(
                rid,
                model,
                chat,
                logprobs_n,
                self.decode_one,
                tools,
                label=self.token_label(req),
                reasoning=self.reasoning,
            )
            return StreamingResponse(
                self._sse(gen, first, writer, req.include_usage, req.continuous_usage, tenant, slo),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        choices: dict[int, fmt.Choice] = {}
        usage = fmt.Usage()
        prompt_lp = None  # one prompt's, on the item (a merged stream puts them on each choice)

        def take(item: dict) -> None:
            nonlocal prompt_lp
            fmt.accumulate(choices, item)
            fmt.observe(item, usage)
            prompt_lp = fmt.prompt_logprobs_of(item) or prompt_lp

        error = await drain(gen, first, take)
        if tenant is not None:
            self.tenants.metrics.observe_generated(tenant, usage.completion_tokens)
        if slo is not None and error is None:
            slo.done(usage.completion_tokens)
        if error is not None:
            return to_response(error)
        label = self.token_label(req)
        prompt_n = getattr(req, "prompt_logprobs", None)
        if prompt_lp is not None:
            for c in choices.values():
                c.prompt_logprobs = c.prompt_logprobs or prompt_lp
        if chat:
            return JSONResponse(
                fmt.chat_body(
                    rid,
                    model,
                    choices,
                    usage,
                    logprobs_n,
                    self.decode_one,
                    tools,
                    label=label,
                    prompt_logprobs_n=prompt_n,
                    reasoning=self.reasoning,
                )
            )
        return JSONResponse(
            fmt.completion_body(
                rid, model, choices, usage, logprobs_n, self.decode_one, label=label, prompt_logprobs_n=prompt_n
            )
        )

    async def _sse(
        self,
        gen,
        first: dict,
        writer: fmt.ChunkWriter,
        include_usage: bool,
        continuous_usage: bool = False,
        tenant: Optional[str] = None,
        slo: Optional["_SloClock"] = None,
    ) -> AsyncIterator[str]:
        usage = fmt.Usage()
        failed = False
        try:
            async for item in stream_items(gen, first):
                if is_error(item):
                    failed = True
                    yield fmt.sse({"error": item["error"]})
                    break
                fmt.observe(item, usage)
                for chunk in writer.chunks(item, usage if continuous_usage else None):
                    yield chunk
            if include_usage:
                yield writer.usage_chunk(usage)
            yield fmt.SSE_DONE
            if slo is not None and not failed:
                slo.done(usage.completion_tokens)
        finally:
            # Client gone (this generator cancelled/closed) or done: cancelling the
            # handle's stream cancels the replica's generator, which aborts the
            # request in the engine and frees its KV blocks.
            gen.cancel()
            if tenant is not None:
                self.tenants.metrics.observe_generated(tenant, usage.completion_tokens)

    # -- HTTP: OpenAI's Responses API (router/api/responses.py) ------------------

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
            body, _, tools = await self.bodies.chat_body(chat, rid)
            self.own([body], self._http_tenant(request))
        except APIError as e:
            return to_response(resp_api.in_responses_terms(e.body))
        gen, first = await self.pools.open_stream(body)
        if is_error(first):
            return to_response(resp_api.in_responses_terms(first))
        run = ResponseRun(
            req,
            rid,
            stem,
            history + req.input_messages(),
            req.model or self.served_model_name,
            self._responses,
            self.reasoning,
            tools,
        )
        if req.stream:
            return StreamingResponse(run.events(gen, first), media_type="text/event-stream", headers=_SSE_HEADERS)
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

    # -- HTTP: embeddings, and vLLM's score and rerank by their similarity ---------

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        req = await self._parse(request, emb_api.EmbeddingRequest)
        self.check_model(req.model)
        if req.dimensions is not None and req.dimensions < 1:
            raise APIError(f"dimensions must be positive, got {req.dimensions}", 400, param="dimensions")
        width = (await self.info()).get("hidden_size") if req.dimensions is not None else None
        if width and req.dimensions != width:  # refused before any input is computed
            raise APIError(
                f"this model's embeddings have {width} dimensions; reducing them (dimensions) is not supported",
                400,
                param="dimensions",
            )
        vectors, prompt_tokens = await self.embed(
            completions.prompt_list(req.input, "input"),
            req.add_special_tokens,
            req.truncate_prompt_tokens,
            req.priority,
            req.model,
            self._http_tenant(request),
        )
        if req.dimensions is not None and req.dimensions != len(vectors[0]):
            raise APIError(
                f"this model's embeddings have {len(vectors[0])} dimensions; reducing them "
                "(dimensions) is not supported",
                400,
                param="dimensions",
            )
        return JSONResponse(
            emb_api.response_body(req.model or self.served_model_name, vectors, req.encoding_format, prompt_tokens)
        )

    @app.post("/v1/score")
    @app.post("/score", include_in_schema=False)  # (aliases, as vLLM serves them)
    async def score(self, request: Request):
        req = await self._parse(request, emb_api.ScoreRequest)
        self.check_model(req.model)
        try:
            pairs = req.pairs()
        except ValueError as e:
            raise APIError(str(e), 400, param="text_2") from None
        scores, tokens = await self._similarities(pairs, req, self._http_tenant(request))
        return JSONResponse(
            emb_api.score_body(
                f"score-{uuid.uuid4().hex}", int(time.time()), req.model or self.served_model_name, scores, tokens
            )
        )

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
        scores, tokens = await self._similarities(
            [(req.query, d) for d in req.documents], req, self._http_tenant(request)
        )
        return JSONResponse(
            emb_api.rerank_body(f"rerank-{uuid.uuid4().hex}", req.model or self.served_model_name, req, scores, tokens)
        )

    async def _similarities(self, pairs: list[tuple[str, str]], req, tenant: Tenant) -> tuple[list[float], int]:
        """Each pair's cosine similarity, every distinct text embedded once; and the tokens read."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors, tokens = await self.embed(
            texts, req.add_special_tokens, req.truncate_prompt_tokens, req.priority, req.model, tenant
        )
        by_text = dict(zip(texts, vectors))
        return [emb_api.cosine(by_text[a], by_text[b]) for a, b in pairs], tokens

    # -- HTTP: LoRA adapters at run time (vLLM's endpoints; router/loras.py) --------

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request):
        req = await self._parse(request, LoadLoRAAdapterRequest)
        await self.loras.load(req.lora_name, req.lora_path, self.pools.replica_calls)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request):
        req = await self._parse(request, UnloadLoRAAdapterRequest)
        await self.loras.unload(req.lora_name, self.pools.replica_calls)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # -- HTTP: models, health, tokenizer, metrics -----------------------------------

    @app.get("/v1/models")
    async def models(self, request: Request):
        self.check_api_key(request.headers.get("authorization"))
        info = await self.info()
        return {"object": "list", "data": [self._model_card(name, info) for name in self.model_ids()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        """OpenAI's retrieve-model (`client.models.retrieve(name)`): the card, or a 404."""
        self.check_api_key(request.headers.get("authorization"))
        self.check_model(model)
        return self._model_card(model, await self.info())

    def _model_card(self, name: str, info: dict) -> dict:
        if name in self.loras:
            return self.loras.card(name, self.served_model_name, self._created, info["max_model_len"])
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "fleetserve",
            "root": info["model_name"],
            "max_model_len": info["max_model_len"],
        }

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
        report = await replica_health(self.pools)  # router/health.py: engines asked, not actors
        if not report["healthy"]:
            return to_response(error_body(f"no healthy engine replica: {report['unhealthy'] or 'none running'}", 503))
        body = {
            "status": "ok" if not report["unhealthy"] else "degraded",
            "num_replicas": len(report["healthy"]),
            "unhealthy": report["unhealthy"],
        }
        prefill = report.get("prefill")
        if prefill is not None:  # P/D: the decode pool above, the prefill pool here
            body["prefill"] = {"num_replicas": len(prefill["healthy"]), "unhealthy": prefill["unhealthy"]}
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
            text = await self.bodies.apply_chat_template(
                [m.flat() for m in req.messages],
                req.add_generation_prompt,
                template_kwargs=req.chat_template_kwargs,
                continue_final_message=req.continue_final_message,
            )
            ids = await self.bodies.tokenize_prompt(text, False, "messages")
        else:
            ids = await self.bodies.tokenize_prompt(req.prompt, req.add_special_tokens, "prompt")
        info = await self.info()
        return {"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        req = await self._parse(request, DetokenizeRequest)
        self.check_model(req.model)
        ids = await self.bodies.tokenize_prompt(req.tokens, False, "tokens")
        return {"prompt": (await self.info())["tokenizer"].decode(ids)}

    @app.get("/metrics")
    async def metrics(self):
        """The replicas' latest metrics reports, then the router's own. No replica is called
        (router/metrics_hub.py), so a scrape costs them nothing and answers under overload."""
        snap = await self.pools.reports.current()
        body = await self._metrics.render(snap.texts, snap.ages, snap.version)
        return PlainTextResponse(body, media_type=METRICS_CONTENT_TYPE)

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
        timeout_s = self.settings.body_timeout_s
        try:
            return await asyncio.wait_for(self._read_body_unbounded(request), timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                f"the request body did not arrive within {timeout_s:g} s", 408, code="request_timeout"
            ) from None

    async def _read_body_unbounded(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
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


# /openapi.json describes the bodies the routes parse themselves (router/api/openapi.py).
add_request_bodies(
    app,
    {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/responses": resp_api.ResponsesRequest,
        "/v1/embeddings": emb_api.EmbeddingRequest,
        "/v1/score": emb_api.ScoreRequest,
        "/v1/rerank": emb_api.RerankRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
    },
)
IngressDeployment = serve.ingress(app)(Ingress)


class _SloClock:
    """One request's times for the SLO goodput metrics (EnginePools.slo_observe)."""

    __slots__ = ("pools", "tenant", "start", "first")

    def __init__(self, pools: EnginePools, tenant: Optional[str], start: float, first: float) -> None:
        self.pools, self.tenant, self.start, self.first = pools, tenant, start, first

    def done(self, tokens: int) -> None:
        tpot = (time.monotonic() - self.first) / (tokens - 1) if tokens > 1 else None
        self.pools.slo_observe(self.tenant, self.first - self.start, tpot)
