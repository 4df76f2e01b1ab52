"""OpenAI request schemas and their mapping onto `SamplingParams`.

Unknown fields are ignored (as vLLM does). Types are checked by pydantic
(mapped to 400 naming the field, never FastAPI's 422 shape); ranges are checked
by `SamplingParams`, whose messages also start with the field name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from fleetserve.router.api.errors import APIError
from fleetserve.router.api.limits import MAX_MESSAGES, check_prompt_count, check_sampling, check_token_lists
from fleetserve.router.api.structured import StructuredOutputFields
from fleetserve.router.api.tool_calls import ToolFields
from fleetserve.scheduler import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk carries the usage so far too.
    continuous_usage_stats: StrictBool = False


class _SamplingRequest(StructuredOutputFields):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    n: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: StrictBool = False
    min_tokens: int = 0
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    priority: int = 0
    user: Optional[str] = None
    cache_salt: Optional[str] = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's: tokens per streamed chunk after the first; raises the server's --stream-interval.
    stream_interval: Optional[int] = None
    # vLLM's: only these tokens may be sampled; words never generated; keep the prompt's
    # last k tokens (-1: as many as leave room for max_tokens).
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    # vLLM's: logprobs name tokens "token_id:<id>" (the server's --return-tokens-as-token-ids
    # turns it on for every request).
    return_tokens_as_token_ids: StrictBool = False
    # vLLM's: the logprobs of the prompt's tokens (and this many likeliest others at each
    # position), in the response body; not with stream (as vLLM).
    prompt_logprobs: Optional[int] = None

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _logprobs(self) -> Optional[int]:
        return None

    def sampling_params(self, default_max_tokens: int, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        """Validated engine sampling params; `APIError` (400, field named) otherwise.

        `defaults`: the model's generation defaults (`--generation-config`), used for
        the fields this request leaves unset; `max_tokens` among them caps the default."""
        defaults = defaults or {}
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs is not available with stream=true", 400, param="prompt_logprobs")
        max_tokens = self._max_tokens()
        if max_tokens is None and defaults.get("max_tokens"):
            default_max_tokens = min(default_max_tokens, int(defaults["max_tokens"]))
        fields: dict[str, Any] = {
            "n": self.n,
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "seed": self.seed,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logprobs": self._logprobs(),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias,
            "structured_outputs": self.structured_outputs_params(),
            "stream_interval": self.stream_interval,
            "allowed_token_ids": check_token_lists(self.logit_bias, self.allowed_token_ids),
            "bad_words": self.bad_words,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "prompt_logprobs": self.prompt_logprobs,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                fields[name] = value
        try:
            params = SamplingParams(**fields)
        except ValueError as e:
            word = str(e).split(" ", 1)[0].rstrip(":")
            raise APIError(str(e), 400, param=word if word in fields or word == "stop" else None) from e
        check_sampling(params)
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(
            self.stream_options and self.stream_options.include_usage and self.stream_options.continuous_usage_stats
        )


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: StrictBool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompt_list(cls, prompt: Any) -> Any:
        """A list of prompts is refused past limits.MAX_PROMPTS before any of it is validated
        (a list of token ids is one prompt: the context bounds it later)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            check_prompt_count(len(prompt))
        return prompt

    def _logprobs(self) -> Optional[int]:
        return self.logprobs

    def sampling_params(self, default_max_tokens: int, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        if self.best_of not in (None, self.n):
            raise APIError("best_of different from n is not supported; use n", 400, param="best_of")
        params = super().sampling_params(default_max_tokens, defaults)
        if self.echo and self.logprobs is not None:  # echoed with the prompt
            params = params.replace(prompt_logprobs=max(self.logprobs, params.prompt_logprobs or 0))
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    def flat(self) -> dict:
        content = self.content
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError("only text content parts are supported", 400, param="messages.content")
                texts.append(part["text"])
            content = "".join(texts)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):  # tool-call turns, for templates that use them
            value = (self.model_extra or {}).get(key)
            if value is not None:
                message[key] = value
        return message


class ChatCompletionRequest(_SamplingRequest, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Optional[int] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: StrictBool = True
    # vLLM's: the last message is left open and the reply goes on with it (a prefilled answer).
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: extra template variables

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> Optional[int]:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError("top_logprobs requires logprobs=true", 400, param="top_logprobs")
            return None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", 400, param="top_logprobs")
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id is accepted and not needed)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


def sampling_dict(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
