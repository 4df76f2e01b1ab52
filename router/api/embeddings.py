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
most `MAX_INPUTS` (at most `limits.FANOUT` in flight at once: `embed_all`); `encoding_format`
"float" or "base64" (little-endian float32, as OpenAI's); `dimensions` only when it is the
model's own width (no Matryoshka truncation); vLLM's `truncate_prompt_tokens` and
`add_special_tokens`.

vLLM's score and rerank APIs for embedding models ride on the same vectors: `POST /v1/score`
(`text_1` against `text_2`: 1:1, 1:N or N:N) and `POST /v1/rerank` (Jina's and Cohere's shape:
`query`, `documents`, `top_n`; also at `/rerank` and `/v2/rerank`) score a pair by the cosine
similarity of the two texts' embeddings, each distinct text embedded once.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool

from fleetserve.router.api.completions import StreamOpener, open_as_own_request
from fleetserve.router.api.errors import APIError
from fleetserve.router.api.limits import FANOUT
from fleetserve.router.streams import drain

MAX_INPUTS = 2048  # OpenAI's limit per request


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


class ScoreRequest(BaseModel):
    """vLLM's /v1/score body."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: StrictBool = True
    priority: int = 0

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) of each score: one text_1 against every text_2, or item by item;
        ValueError (naming the rule, as vLLM's) for anything else."""
        left = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        right = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not left or not right:
            raise ValueError("text_1 and text_2 must each hold at least one text")
        if len(left) == 1:
            return [(left[0], r) for r in right]
        if len(left) != len(right):
            raise ValueError(
                f"input lengths must be either 1:1, 1:N or N:N; got {len(left)} text_1 and {len(right)} text_2"
            )
        return list(zip(left, right))


class RerankRequest(BaseModel):
    """Jina's / Cohere's rerank body, as vLLM's /v1/rerank takes it."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: int = 0  # 0 (or none): every document
    return_documents: StrictBool = True
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: StrictBool = True
    priority: int = 0


def cosine(a: list[float], b: list[float]) -> float:
    """Of two embeddings (normalized already: their dot product, clamped to [-1, 1])."""
    return max(-1.0, min(1.0, sum(x * y for x, y in zip(a, b, strict=True))))


def score_body(request_id: str, created: int, model: str, scores: list[float], prompt_tokens: int) -> dict:
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }


def rerank_body(request_id: str, model: str, req: RerankRequest, scores: list[float], prompt_tokens: int) -> dict:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if req.top_n > 0:
        order = order[: req.top_n]
    return {
        "id": request_id,
        "model": model,
        "usage": {"total_tokens": prompt_tokens},
        "results": [
            {
                "index": i,
                "relevance_score": scores[i],
                **({"document": {"text": req.documents[i]}} if req.return_documents else {}),
            }
            for i in order
        ],
    }


def encode(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def response_body(model: str, vectors: list[list[float]], encoding_format: str, prompt_tokens: int) -> dict:
    return {
        "object": "list",
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v, encoding_format)} for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def check_input_count(inputs: list) -> None:
    if len(inputs) > MAX_INPUTS:
        raise APIError(f"input may hold at most {MAX_INPUTS} items, got {len(inputs)}", 400, param="input")


async def embed_all(open_stream: StreamOpener, bodies: list[dict]) -> list[list[float]]:
    """One vector per engine body (`open_stream`: the ingress's), each body a request of its
    own, at most `FANOUT` of them in flight; the first error, as an APIError."""
    gate = asyncio.Semaphore(FANOUT)

    async def one(body: dict) -> list[float]:
        async with gate:  # (each input its own Serve request: concurrent calls sharing one hang)
            gen, first = await open_as_own_request(open_stream, body)
            got: list = []
            error = await drain(gen, first, lambda item: got.append(item["embedding"]) if "embedding" in item else None)
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
        for t in tasks:
            if t.done() and not t.cancelled() and (err := t.exception()) is not None:
                raise err
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
