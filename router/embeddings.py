"""OpenAI's embeddings API (`POST /v1/embeddings`) on the generative model being served.

An input's embedding is the model's final hidden state (after the last norm) at the input's
last token, L2-normalized: vLLM's LAST pooling with `normalize`, which is what vLLM gives a
decoder model run as an embedding model (`--runner pooling`). Here the same engine serves
both: an embedding is a request with `max_tokens=1` and `SamplingParams.embed`, so it is
scheduled, batched, prefix-cached and routed like any other prompt, and the hidden state is
read in the step that ends the prompt (replica/worker/model_runner.py). Whether a
generative model's embeddings are good for retrieval is the model's business; an
embedding-trained decoder (e.g. Qwen3-Embedding, e5-mistral) served this way gives vLLM's
vectors.

`input` takes OpenAI's four shapes (a string, strings, token ids, lists of token ids), at
most `MAX_INPUTS`; `encoding_format` "float" or "base64" (little-endian float32, as OpenAI's);
`dimensions` only when it is the model's own width (no Matryoshka truncation); vLLM's
`truncate_prompt_tokens` and `add_special_tokens`.
"""

from __future__ import annotations

import base64
import struct
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool

MAX_INPUTS = 2048  # OpenAI's limit per request
CONCURRENCY = 16  # inputs of one request in flight at once (the rest wait their turn)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    input: Union[str, list[int], list[str], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM's extras
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: StrictBool = True
    priority: int = 0


def encode(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def response_body(model: str, vectors: list[list[float]], encoding_format: str, prompt_tokens: int) -> dict:
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
