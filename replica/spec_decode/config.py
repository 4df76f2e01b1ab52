"""`--speculative-config '<json>'`, with vLLM's field names and defaults.

{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
{"model": "/path/to/draft", "num_speculative_tokens": 4}
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    method: Optional[Literal["ngram", "draft_model"]] = None
    num_speculative_tokens: int = Field(ge=1, le=32)
    # A draft model: a registry name, .gguf file or HF folder (same tokenizer as the target).
    model: Optional[str] = None
    prompt_lookup_min: Optional[int] = Field(None, ge=1)
    prompt_lookup_max: Optional[int] = Field(None, ge=1)
    # fleetserve's: each request earns its draft length from its acceptance
    # (scheduler/spec_decode.py); False drafts num_speculative_tokens always, as vLLM.
    adaptive_draft_length: bool = True
    # fleetserve's: a step of up to this many tokens costs about what a one-token step
    # costs (the forward is bound by reading the weights, not by arithmetic), so drafts
    # that fit in it are nearly free and go out at full length even where a request has
    # not earned it (a lone request, the tail of a batch). None: the device's default
    # (`default_free_draft_tokens`); 0: off.
    free_draft_tokens: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _resolve(self) -> "SpeculativeConfig":
        method = self.method
        if method is None:
            # vLLM infers the method: a draft model when `model` is given
            # ("ngram" as the model name is the old spelling of n-gram).
            if self.model in ("ngram", "[ngram]"):
                method = "ngram"
            elif self.model is not None:
                method = "draft_model"
            else:
                raise ValueError("speculative config: give a 'method' ('ngram') or a draft 'model'")
            object.__setattr__(self, "method", method)
        if method == "draft_model" and not self.model:
            raise ValueError("speculative config: method 'draft_model' needs a 'model'")
        if method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: both 5 when neither is given, else the one given.
            if lo is None:
                lo = 5 if hi is None else hi
            if hi is None:
                hi = lo
            if lo > hi:
                raise ValueError(f"speculative config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        return self

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | SpeculativeConfig | None") -> Optional["SpeculativeConfig"]:
        """From the CLI's JSON string, a dict (YAML) or an instance; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        return cls(**value)

    def resolve_free_draft_tokens(self, device: str) -> int:
        if self.free_draft_tokens is not None:
            return self.free_draft_tokens
        return default_free_draft_tokens(device)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the drafts that the proposer writes into (scheduler side)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


# How many tokens a step takes for about the price of one: on a CPU, reading the weights
# bounds a small step, so a few more rows cost little (docs/serving/spec-decode.md has the
# figures). On a GPU a small model's step is launch- and bandwidth-bound far longer; 64
# there is a conservative guess, not a measurement (no GPU has run it).
FREE_DRAFT_TOKENS = {"cpu": 8, "cuda": 64}


def default_free_draft_tokens(device: str) -> int:
    if device == "auto":
        from fleetserve.replica.worker.device import select_device

        device = select_device("auto").type
    return FREE_DRAFT_TOKENS.get(device, 0)
