"""Hostile clients, one per class of the hardening review (issue 51), for the guard test
(tests/router/test_hostile_load.py) and the soak benchmark (benchmarks/soak.py --hostile).

Each class is a coroutine that sends one request shaped to cost the server as much as a
client without special rights can make it cost, and returns an `Outcome`: `clean` when the
server answered as it promises (a 4xx with an OpenAI-style error body, a 200 whose work
was bounded, a stream that ends with an error event), otherwise what went wrong. Nothing
here is a mock: the requests go through the real HTTP server.

The classes:
  prompt_list    /v1/completions with thousands of prompts in one body (capped at 256)
  bias_map       logit_bias with thousands of entries (over its bound: a 400), or
                 allowed_token_ids with thousands of repeated ids (deduped: served)
  long_prompt    a prompt of tens of kB with truncate_prompt_tokens (tokenized off the loop,
                 only its tail: a 200)
  slow_grammar   a JSON schema that is slow to compile (a deadline, then an error)
  contradiction  allowed_token_ids [eos] with min_tokens > 0 (a 400), or an allowed id the
                 grammar forbids (an error finish)
  bogus_lora     /v1/load_lora_adapter on paths outside the configured roots (a 4xx that says
                 nothing about the file system)
  scrape_flood   GET /metrics (answered from the replicas' reports, costing them nothing)
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import httpx

# A schema whose xgrammar compile takes seconds: a long fixed-length string pattern.
SLOW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {f"k{i}": {"type": "string", "minLength": 50, "maxLength": 4000} for i in range(40)},
    "required": [f"k{i}" for i in range(40)],
}


@dataclass
class Target:
    """What the hostile clients need to know about the server they attack."""

    model: str
    eos_token_id: int
    headers: dict[str, str] = field(default_factory=dict)
    max_body_bytes: int = 64 * 1024
    slow_schema: dict[str, Any] = field(default_factory=lambda: SLOW_SCHEMA)
    bogus_lora_paths: tuple[str, ...] = ("/etc", "/nonexistent/adapter", "../../../../root", "/proc/self")


@dataclass
class Outcome:
    cls: str
    clean: bool
    status: int
    detail: str = ""
    seconds: float = 0.0


def _is_error_body(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and bool(err.get("message")) and set(err) >= {"message", "type", "param", "code"}


def _refused(cls: str, r: httpx.Response, start: float, allowed: tuple[int, ...] = (400, 413, 422, 429)) -> Outcome:
    ok = r.status_code in allowed and _is_error_body(r)
    return Outcome(cls, ok, r.status_code, "" if ok else r.text[:300], time.monotonic() - start)


async def prompt_list(client: httpx.AsyncClient, t: Target, rng: random.Random) -> Outcome:
    n = max(300, min(20_000, t.max_body_bytes // 6))  # as many as the body limit lets through
    body = {"model": t.model, "prompt": ["a"] * n, "max_tokens": 1}
    start = time.monotonic()
    return _refused("prompt_list", await client.post("/v1/completions", json=body, headers=t.headers), start)


async def bias_map(client: httpx.AsyncClient, t: Target, rng: random.Random) -> Outcome:
    start = time.monotonic()
    if rng.random() < 0.5:
        n = min(5000, t.max_body_bytes // 16)
        extra: dict[str, Any] = {"logit_bias": {str(i): 1.0 for i in range(n)}}
    else:
        n = min(20_000, t.max_body_bytes // 8)
        extra = {"allowed_token_ids": [i % 300 for i in range(n)]}
    body = {"model": t.model, "prompt": "hostile bias", "max_tokens": 4, **extra}
    r = await client.post("/v1/completions", json=body, headers=t.headers)
    if "allowed_token_ids" in extra and r.status_code == 200:  # under the bound once deduped: served
        return Outcome("bias_map", True, 200, "", time.monotonic() - start)
    return _refused("bias_map", r, start)


async def long_prompt(client: httpx.AsyncClient, t: Target, rng: random.Random) -> Outcome:
    size = max(9000, t.max_body_bytes - 1024)
    prompt = "".join(f"w{rng.randint(0, 99)} " for _ in range(size // 3))[:size]
    body = {"model": t.model, "prompt": prompt, "truncate_prompt_tokens": 8, "max_tokens": 1}
    start = time.monotonic()
    r = await client.post("/v1/completions", json=body, headers=t.headers)
    ok = r.status_code == 200 and r.json().get("usage", {}).get("prompt_tokens") == 8
    return Outcome("long_prompt", ok, r.status_code, "" if ok else r.text[:300], time.monotonic() - start)


async def slow_grammar(client: httpx.AsyncClient, t: Target, rng: random.Random) -> Outcome:
    """A slow schema: refused at validation, or compiled past its deadline and ended with an
    error, or (when the compile is cached from an earlier attempt) served. Never a hang
    or a 5xx."""
    schema = json.loads(json.dumps(t.slow_schema))
    schema.setdefault("description", f"hostile {rng.randint(0, 1 << 30)}")  # a fresh cache key
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": "json please"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}},
    }
    start = time.monotonic()
    r = await client.post("/v1/chat/completions", json=body, headers=t.headers)
    if r.status_code == 200:
        finish = r.json()["choices"][0].get("finish_reason")
        ok = finish in ("length", "stop", "error")
        return Outcome("slow_grammar", ok, 200, f"finish {finish}", time.monotonic() - start)
    return _refused("slow_grammar", r, start, (400, 408, 422, 429, 503, 504))


async def contradiction(client: httpx.AsyncClient, t: Target, rng: random.Random) -> Outcome:
    start = time.monotonic()
    if rng.random() < 0.5:
        body = {
            "model": t.model,
            "prompt": "contradiction",
            "max_tokens": 8,
            "min_tokens": 4,
            "allowed_token_ids": [t.eos_token_id],
        }
        return _refused("contradiction", await client.post("/v1/completions", json=body, headers=t.headers), start)
    # allowed ids the grammar forbids: JSON object text never starts with a digit
    tok = await client.post(
        "/tokenize", json={"model": t.model, "prompt": "7", "add_special_tokens": False}, headers=t.headers
    )
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": "contradiction"}],
        "max_tokens": 8,
        "allowed_token_ids": tok.json()["tokens"][:1],
        "response_format": {"type": "json_object"},
    }
    r = await client.post("/v1/chat/completions", json=body, headers=t.headers)
    if r.status_code == 200:
        finish = r.json()["choices"][0].get("finish_reason")
        return Outcome("contradiction", finish == "error", 200, f"finish {finish}", time.monotonic() - start)
    return _refused("contradiction", r, start)


async def bogus_lora(client: httpx.AsyncClient, t: Target, rng: random.Random) -> Outcome:
    path = rng.choice(t.bogus_lora_paths)
    body = {"lora_name": f"bogus-{rng.randint(0, 1 << 30)}", "lora_path": path}
    start = time.monotonic()
    r = await client.post("/v1/load_lora_adapter", json=body, headers=t.headers)
    out = _refused("bogus_lora", r, start, (400, 401, 403, 404))
    if out.clean and any(p in r.text for p in ("/etc", "/proc", "nonexistent", "/root", "exist", "directory")):
        return Outcome("bogus_lora", False, r.status_code, f"error tells about the file system: {r.text[:200]}")
    return out


async def scrape_flood(client: httpx.AsyncClient, t: Target, rng: random.Random) -> Outcome:
    start = time.monotonic()
    r = await client.get("/metrics", headers=t.headers)
    ok = r.status_code == 200 and "vllm:" in r.text
    return Outcome("scrape_flood", ok, r.status_code, "" if ok else r.text[:300], time.monotonic() - start)


CLASSES: dict[str, Callable[[httpx.AsyncClient, Target, random.Random], Awaitable[Outcome]]] = {
    "prompt_list": prompt_list,
    "bias_map": bias_map,
    "long_prompt": long_prompt,
    "slow_grammar": slow_grammar,
    "contradiction": contradiction,
    "bogus_lora": bogus_lora,
    "scrape_flood": scrape_flood,
}


async def hostile_worker(
    client: httpx.AsyncClient,
    target: Target,
    cls: str,
    stop_at: float,
    outcomes: list[Outcome],
    seed: int = 0,
    pause_s: float = 0.0,
) -> None:
    """Send requests of one class until `stop_at` (time.monotonic()); every answer, or the
    transport error that replaced it, goes to `outcomes`."""
    import asyncio

    rng, fn = random.Random(seed), CLASSES[cls]
    while time.monotonic() < stop_at:
        start = time.monotonic()
        try:
            outcomes.append(await fn(client, target, rng))
        except httpx.HTTPError as e:
            outcomes.append(Outcome(cls, False, 0, repr(e)[:300], time.monotonic() - start))
        if pause_s:
            await asyncio.sleep(pause_s)


def summary(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """class -> {sent, clean, statuses, worst (s), first unclean detail}."""
    out: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        s = out.setdefault(o.cls, {"sent": 0, "clean": 0, "statuses": {}, "worst_s": 0.0, "unclean": None})
        s["sent"] += 1
        s["clean"] += o.clean
        s["statuses"][o.status] = s["statuses"].get(o.status, 0) + 1
        s["worst_s"] = max(s["worst_s"], o.seconds)
        if not o.clean and s["unclean"] is None:
            s["unclean"] = f"{o.status} {o.detail}"
    return out


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]
