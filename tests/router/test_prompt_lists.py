"""A `/v1/completions` body with a list of prompts (issue 51): bounded before any work, and
at most `limits.FANOUT` of its prompts in flight at once.

Before: one body of 400,000 one-letter prompts was validated, tokenized and opened at once
(400,000 engine requests against Serve's queue of 512); the ingress logged ~330k
backpressure drops, a concurrent stream stalled for ~80 s, and Serve replaced the ingress."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest

from fleetserve.router.api.completions import MergedStream
from fleetserve.router.api.limits import FANOUT, MAX_PROMPTS

CMPL = "/v1/completions"


def _post(server, body: dict, timeout: float = 120):
    return httpx.post(
        server.base_url + CMPL,
        content=json.dumps(body).encode(),
        timeout=timeout,
        headers={"Content-Type": "application/json", **server.headers()},
    )


# -- MergedStream, over a fake opener (the real interface: (stream, first item)) -----------


class _FakeStream:
    """An engine request of `steps` items; counts how many are open at once."""

    def __init__(self, i: int, steps: int, live: dict) -> None:
        self.i, self.left, self.live = i, steps, live
        live["now"] += 1
        live["max"] = max(live["max"], live["now"])

    def item(self) -> dict:
        self.left -= 1
        finished = self.left == 0
        if finished:
            self.live["now"] -= 1
        return {
            "outputs": [{"index": 0, "text": f"p{self.i}", "token_ids": [self.i]}],
            "finished": finished,
            "num_cached_tokens": 0,
        }

    async def __anext__(self) -> dict:
        await asyncio.sleep(0.001)
        return self.item()

    def cancel(self) -> None:
        self.live["cancelled"] += 1


def _opener(live: dict, steps: int = 3, refuse: frozenset = frozenset()):
    async def open_stream(body: dict):
        i = body["i"]
        await asyncio.sleep(0.001)
        stream = _FakeStream(i, steps, live)
        if i in refuse:
            return stream, {"error": {"message": "overloaded", "type": "x", "param": None, "code": None}, "status": 429}
        return stream, stream.item()

    return open_stream


def _bodies(count: int) -> list[dict]:
    return [{"i": i, "prompt_token_ids": [1, 2]} for i in range(count)]


async def _drain(stream, first) -> list[dict]:
    """Items up to the end or the first error (where the ingress's readers stop)."""
    items = [first]
    async for item in stream:
        items.append(item)
        if "error" in item:
            break
    return items


def test_merged_stream_keeps_at_most_window_prompts_in_flight_and_returns_every_choice():
    live = {"now": 0, "max": 0, "cancelled": 0}

    async def go():
        stream, first = await MergedStream.open(_opener(live), _bodies(50), 1, None, window=4)
        return await _drain(stream, first)

    items = asyncio.run(go())
    assert live["max"] == 4 and live["now"] == 0
    finished = sorted(o["index"] for it in items if it["finished"] for o in it["outputs"])
    assert finished == list(range(50))
    assert items[0]["prompt_tokens"] == 100 and all("prompt_tokens" not in it for it in items[1:])


def test_merged_stream_refusal_of_a_first_prompt_is_the_answer_and_a_later_one_ends_the_stream():
    live = {"now": 0, "max": 0, "cancelled": 0}

    async def first_refused():
        stream, first = await MergedStream.open(_opener(live, refuse=frozenset({2})), _bodies(10), 1, None, window=4)
        return first

    first = asyncio.run(first_refused())
    assert first["status"] == 429 and live["cancelled"] == 4  # the window's streams all cancelled

    live = {"now": 0, "max": 0, "cancelled": 0}

    async def later_refused():
        stream, first = await MergedStream.open(_opener(live, refuse=frozenset({7})), _bodies(10), 1, None, window=4)
        items = await _drain(stream, first)
        stream.cancel()
        return items

    items = asyncio.run(later_refused())
    assert items[-1]["status"] == 429  # the error item is the stream's last
    assert not any(o["index"] >= 8 for it in items if "outputs" in it for o in it["outputs"])


def test_merged_stream_cancel_also_cancels_a_prompt_opened_but_not_yet_read():
    """A client gone while the next prompt's stream has just opened: that stream is
    cancelled too (its engine request would otherwise run on with nobody reading it)."""
    live = {"now": 0, "max": 0, "cancelled": 0}

    async def go():
        stream, first = await MergedStream.open(_opener(live, steps=1), _bodies(3), 1, None, window=1)
        await asyncio.sleep(0.05)  # prompt 0 finished at once: prompt 1's opening completes
        stream.cancel()

    asyncio.run(go())
    assert live["cancelled"] == 2  # prompt 0's stream, and prompt 1's, opened but unread


# -- through the real server ---------------------------------------------------------------


def test_huge_prompt_list_is_refused_at_once_while_a_stream_runs(server):
    """12,000 prompts (all the 64 KiB test body holds): a 400 naming `prompt` in well under a
    second, while a concurrent stream keeps its pace; the server serves after, nothing leaks."""

    def stream_once() -> list[float]:
        gaps, last = [], None
        with httpx.stream(
            "POST",
            server.base_url + CMPL,
            timeout=120,
            headers=server.headers(),
            json={"prompt": "a steady stream", "max_tokens": 64, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        return gaps

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_once)
        time.sleep(0.2)
        started = time.monotonic()
        r = _post(server, {"prompt": ["a"] * 12_000, "max_tokens": 1})
        refused_in = time.monotonic() - started
        gaps = streaming.result()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and f"at most {MAX_PROMPTS} prompts" in err["message"], err
    assert refused_in < 5.0, refused_in
    assert len(gaps) >= 60 and max(gaps) < 5.0, max(gaps)
    ok = _post(server, {"prompt": "after the flood", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()


@pytest.mark.slow
def test_the_largest_prompt_list_is_served_in_windows(server):
    """MAX_PROMPTS prompts of token ids, 24 tokens each: every choice comes back, indexed as
    OpenAI numbers them, and never more than FANOUT (plus a concurrent client's 1) engine
    requests of it ran at once on any replica."""
    prompts = [[5 + i % 50, 7] for i in range(MAX_PROMPTS)]
    peak = {"running": 0}
    done = {"flag": False}

    def watch() -> None:
        while not done["flag"]:
            loads = server.replica_loads()
            peak["running"] = max(
                peak["running"], sum(load["num_running"] + load["num_waiting"] for load in loads.values())
            )
            time.sleep(0.05)

    server.replica_loads()  # this process's router exists before the watch starts
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(watch)
        try:
            r = _post(server, {"prompt": prompts, "max_tokens": 24, "ignore_eos": True})
        finally:
            done["flag"] = True
        watcher.result()
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == list(range(MAX_PROMPTS))
    assert body["usage"]["prompt_tokens"] == 2 * MAX_PROMPTS
    print("peak engine requests in flight:", peak["running"])
    assert 0 < peak["running"] <= FANOUT, peak
    server.wait_idle()
