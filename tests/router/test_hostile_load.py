"""The guard for the class (issue 51): normal clients stream while hostile clients send,
concurrently, every class the hardening review found (router/hostile.py): huge prompt
lists, huge bias maps, long prompts with truncation, slow grammars, contradictory masks,
bogus LoRA paths and a flood of scrapes. Normal clients must all succeed with their ITL p99
close to their run alone, every hostile request gets a clean answer, /health stays true
(green: nothing is broken) throughout, and no KV block is leaked."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from fleetserve.replica.testing import EOS_TOKEN_ID
from fleetserve.router import hostile

NORMAL_CLIENTS = 2
ALONE_S, UNDER_ATTACK_S = 4.0, 8.0


async def _normal(client: httpx.AsyncClient, server, stop_at: float, itl: list[float], failures: list[str]) -> None:
    body = {"model": server.model, "prompt": "a normal client", "max_tokens": 32, "ignore_eos": True, "stream": True}
    while time.monotonic() < stop_at:
        async with client.stream("POST", "/v1/completions", json=body, headers=server.headers()) as r:
            if r.status_code != 200:
                failures.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                continue
            last, tokens, done = None, 0, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if "error" in data:
                        failures.append(f"stream error {data['error']}")
                    now = time.monotonic()
                    if last is not None:
                        itl.append(now - last)
                    last, tokens = now, tokens + 1
            if not done or tokens < 32:
                failures.append(f"stream ended after {tokens} chunks, done={done}")


async def _health(client: httpx.AsyncClient, stop_at: float, samples: list[tuple[int, float]]) -> None:
    while time.monotonic() < stop_at:
        start = time.monotonic()
        try:
            status = (await client.get("/health")).status_code
        except httpx.HTTPError:
            status = 0
        samples.append((status, time.monotonic() - start))
        await asyncio.sleep(0.25)


async def _phase(server, seconds: float, attack: bool) -> dict:
    stop_at = time.monotonic() + seconds
    itl: list[float] = []
    failures: list[str] = []
    outcomes: list[hostile.Outcome] = []
    health: list[tuple[int, float]] = []
    target = hostile.Target(
        model=server.model,
        eos_token_id=EOS_TOKEN_ID,
        headers=server.headers(),
        max_body_bytes=server.config.http.max_body_bytes,
    )
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
        tasks = [_normal(client, server, stop_at, itl, failures) for _ in range(NORMAL_CLIENTS)]
        tasks.append(_health(client, stop_at, health))
        if attack:
            for i, cls in enumerate(hostile.CLASSES):
                workers = 2 if cls == "scrape_flood" else 1
                tasks += [
                    hostile.hostile_worker(client, target, cls, stop_at, outcomes, seed=i * 10 + w)
                    for w in range(workers)
                ]
        await asyncio.gather(*tasks)
    return {"itl": itl, "failures": failures, "outcomes": outcomes, "health": health}


def test_normal_clients_unharmed_by_every_hostile_class_at_once(server):
    server.wait_idle()
    alone = asyncio.run(_phase(server, ALONE_S, attack=False))
    attacked = asyncio.run(_phase(server, UNDER_ATTACK_S, attack=True))

    report = hostile.summary(attacked["outcomes"])
    p99_alone = hostile.percentile(alone["itl"], 0.99)
    p99_attacked = hostile.percentile(attacked["itl"], 0.99)
    print(f"ITL p99 alone {p99_alone * 1e3:.1f} ms, under attack {p99_attacked * 1e3:.1f} ms; {report}")
    print("health (status, s) under attack:", [(st, round(s, 2)) for st, s in attacked["health"]])
    for phase in (alone, attacked):
        assert not phase["failures"], phase["failures"][:5]
        assert all(status == 200 for status, _ in phase["health"]), phase["health"]
        assert max(s for _, s in phase["health"]) < 5.0, "a /health answer took seconds"

    assert set(report) == set(hostile.CLASSES), f"a class sent nothing: {report}"
    unclean = {cls: s for cls, s in report.items() if s["clean"] != s["sent"]}
    assert not unclean, unclean

    # 2x is the target (benchmarks/soak.py --hostile measures it on the real model); on two
    # shared cores the hostile clients' own CPU shows in a tiny model's ITL, so the test
    # allows 50 ms of slack over 2x: what it must catch is a stall (the original defect
    # stalled every stream for about 80 s), not a percent.
    assert p99_attacked <= 2 * p99_alone + 0.05, (p99_alone, p99_attacked)

    server.wait_idle()  # no request or KV block left behind
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": server.model, "prompt": "after", "max_tokens": 4},
        headers=server.headers(),
        timeout=60,
    )
    assert r.status_code == 200, r.text
