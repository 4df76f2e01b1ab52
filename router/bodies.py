"""From a validated API request to engine request bodies (HTTP and gRPC alike).

The prompt is checked and tokenized here, with the engines' tokenizer (from their info),
so the request router can hash its token blocks to pick a replica: a string is bounded by
characters before it is tokenized (limits.check_prompt_chars), token ids must lie in the
vocabulary, `truncate_prompt_tokens` keeps the prompt's last tokens, and the prompt plus
`max_tokens` must fit the context (400 naming the field, `context_length_exceeded`). The
body is what `EngineReplica.generate` takes: ids, sampling params, priority, cache salt,
and the LoRA adapter's fields when `model` names one.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Optional, Union

from fleetserve.replica.engine.chat_template import check_continue_final_message, check_template_kwargs
from fleetserve.router.api import completions
from fleetserve.router.api.errors import APIError
from fleetserve.router.api.limits import check_prompt_chars
from fleetserve.router.api.protocol import ChatCompletionRequest, CompletionRequest, sampling_dict
from fleetserve.router.engine_pools import EnginePools
from fleetserve.router.loras import LoRAAdmin
from fleetserve.scheduler.sampling_params import SamplingParams, truncate_prompt

# Texts longer than this are tokenized (or rendered) on a worker thread, where a long one
# cannot stall the loop every stream of this ingress shares; shorter ones cost less on the
# loop than the hop.
OFF_LOOP_CHARS = 8192
# Tokens of margin before the tail a truncating request keeps (see tokenize_prompt).
TAIL_SLACK_TOKENS = 64


class BodyBuilder:
    def __init__(self, pools: EnginePools, loras: LoRAAdmin) -> None:
        self._pools, self._loras = pools, loras

    async def tokenize_prompt(
        self, prompt: Union[str, list[int]], add_special_tokens: bool, param: str, truncating: bool = False
    ) -> list[int]:
        """`truncating`: the request keeps only the prompt's last tokens (at most the context),
        so a longer prompt is fine; only its tail is tokenized, the characters that can hold
        the context plus `TAIL_SLACK_TOKENS` (a token covers at most `max_token_chars`, so the
        tokens kept are the ones a whole tokenization would end with, but for a boundary
        that a tokenizer merges across more than the slack). A long text is tokenized on a
        worker thread, not on the loop every stream of this ingress shares."""
        info = await self._pools.info()
        tok = info["tokenizer"]
        if isinstance(prompt, str):
            if "max_token_chars" in info:
                if truncating:
                    tail = (info["max_model_len"] + TAIL_SLACK_TOKENS) * info["max_token_chars"]
                    prompt = prompt[-tail:] if len(prompt) > tail else prompt
                else:
                    check_prompt_chars(prompt, info["max_model_len"], info["max_token_chars"], param)
            if len(prompt) > OFF_LOOP_CHARS:
                encoded = await asyncio.to_thread(tok, prompt, add_special_tokens=add_special_tokens)
                return list(encoded.input_ids)
            return list(tok(prompt, add_special_tokens=add_special_tokens).input_ids)
        vocab = len(tok)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"{param} contains token ids outside the vocabulary [0, {vocab})", 400, param=param)
        return list(prompt)

    async def truncate(self, token_ids: list[int], k: Optional[int], max_tokens: Optional[int]) -> list[int]:
        """The prompt as `truncate_prompt_tokens` keeps it (vLLM's: its last tokens)."""
        if k is None:
            return token_ids
        try:
            return truncate_prompt(token_ids, k, (await self._pools.info())["max_model_len"], max_tokens)
        except ValueError as e:
            raise APIError(str(e), 400, param="truncate_prompt_tokens") from None

    async def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: Optional[list[dict]] = None,
        template_kwargs: Optional[dict] = None,
        continue_final_message: bool = False,
    ) -> str:
        tok = (await self._pools.info())["tokenizer"]
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
        render = functools.partial(
            tok.apply_chat_template,
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
        try:
            # Jinja over a long conversation: off the loop, as a long prompt's tokenization.
            if sum(len(str(m.get("content") or "")) for m in messages) > OFF_LOOP_CHARS:
                return str(await asyncio.to_thread(render))
            return str(render())
        except Exception as e:  # jinja errors, missing template: the messages are at fault
            raise APIError(f"messages could not be rendered with the chat template: {e}", 400, param="messages") from e

    async def build_body(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: Optional[str],
        explicit_max_tokens: Optional[int],
        param: str,
        model: Optional[str] = None,
    ) -> dict:
        """The engine body of one prompt; `model` (the request's) picks a LoRA adapter when it
        names one."""
        max_len = (await self._pools.info())["max_model_len"]
        if not token_ids:
            raise APIError(f"{param} must not be empty", 400, param=param)
        if len(token_ids) >= max_len:
            raise APIError(
                f"This model's maximum context length is {max_len} tokens. However, "
                f"your prompt has {len(token_ids)} tokens; shorten the {param}.",
                400,
                param=param,
                code="context_length_exceeded",
            )
        if explicit_max_tokens is not None and len(token_ids) + explicit_max_tokens > max_len:
            raise APIError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {len(token_ids) + explicit_max_tokens} tokens "
                f"({len(token_ids)} in the prompt, {explicit_max_tokens} for the "
                "completion); reduce max_tokens or the prompt.",
                400,
                param="max_tokens",
                code="context_length_exceeded",
            )
        # Truncated here, once: a migrated or handed-off request resends its prompt plus
        # what it generated, which the engine must not cut again.
        sampling = dict(sampling_dict(params), truncate_prompt_tokens=None)
        return {
            "request_id": request_id,
            "prompt_token_ids": token_ids,
            "sampling_params": sampling,
            "priority": priority,
            "cache_salt": cache_salt,
            **self._loras.body_fields(model),
        }

    async def completion_bodies(self, req: CompletionRequest, rid: str) -> tuple[list, list[dict], SamplingParams]:
        """(prompts, one engine body per prompt, sampling params) of a completions request:
        fill-in-the-middle with `suffix`, the model's generation defaults."""
        prompts = completions.prompt_list(req.prompt)
        info = await self._pools.info()
        if req.suffix is not None:
            prompts = [completions.fim_prompt(info["tokenizer"], p, req.suffix) for p in prompts]
        params = req.sampling_params(default_max_tokens=16, defaults=info.get("generation_defaults"))
        bodies = []
        for i, prompt in enumerate(prompts):
            token_ids = await self.tokenize_prompt(
                prompt, True, "prompt", truncating=req.truncate_prompt_tokens is not None
            )
            token_ids = await self.truncate(token_ids, req.truncate_prompt_tokens, req.max_tokens)
            bodies.append(
                await self.build_body(
                    rid if len(prompts) == 1 else f"{rid}-{i}",
                    token_ids,
                    params,
                    req.priority,
                    req.cache_salt,
                    req.max_tokens,
                    "prompt",
                    req.model,
                )
            )
        return prompts, bodies, params

    async def chat_body(self, req: ChatCompletionRequest, rid: str):
        """(engine body, sampling params, tool plan or None) of a chat request: the chat
        template with the tools, the sampling params with the model's defaults, a forced
        tool call's grammar. `/v1/chat/completions`, `/v1/responses` and gRPC's Chat share it
        (each checks `model` first)."""
        tools = req.tool_plan()
        text = await self.apply_chat_template(
            [m.flat() for m in req.messages],
            req.add_generation_prompt,
            tools.template_tools() if tools else None,
            req.chat_template_kwargs,
            req.continue_final_message,
        )
        token_ids = await self.tokenize_prompt(
            text, False, "messages", truncating=req.truncate_prompt_tokens is not None
        )
        token_ids = await self.truncate(token_ids, req.truncate_prompt_tokens, req._max_tokens())
        info = await self._pools.info()
        params = req.sampling_params(
            default_max_tokens=max(1, info["max_model_len"] - len(token_ids)), defaults=info.get("generation_defaults")
        )
        if tools is not None and tools.mode != "auto":
            if params.structured_outputs is not None:
                raise APIError(
                    "a forced tool_choice cannot be combined with another structured output constraint",
                    400,
                    param="tool_choice",
                )
            params = params.replace(structured_outputs=tools.structured_outputs())
        body = await self.build_body(
            rid, token_ids, params, req.priority, req.cache_salt, req._max_tokens(), "messages", req.model
        )
        return body, params, tools

    async def embedding_bodies(
        self,
        rid: str,
        inputs: list,
        add_special_tokens: bool,
        truncate_prompt_tokens: Optional[int],
        priority: int,
        model: Optional[str] = None,
    ) -> list[dict]:
        """One engine body per input (max_tokens=1, embed)."""
        params = SamplingParams(max_tokens=1, temperature=0.0, embed=True)
        bodies = []
        for i, prompt in enumerate(inputs):
            token_ids = await self.tokenize_prompt(
                prompt, add_special_tokens, "input", truncating=truncate_prompt_tokens is not None
            )
            token_ids = await self.truncate(token_ids, truncate_prompt_tokens, 1)
            bodies.append(await self.build_body(f"{rid}-{i}", token_ids, params, priority, None, None, "input", model))
        return bodies
