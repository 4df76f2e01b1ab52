"""Hostile input found by probing the server (issue 15): each gets a 4xx (gRPC
INVALID_ARGUMENT), none a 500, none wedges a replica; afterwards the server serves and no
KV block is held."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import grpc
import httpx
import pytest

from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"

# (name, path, raw JSON body, status, param)
RAW_CASES = [
    ("lone surrogate in prompt", CMPL, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    (
        "lone surrogate in chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages.0.content",
    ),
    ("lone surrogate in model", CMPL, b'{"model": "\\ud800", "prompt": "a"}', 400, "model"),
    ("lone surrogate in /tokenize", "/tokenize", b'{"prompt": "\\ud834"}', 400, "prompt"),
    ("nested 10,000 deep", CMPL, b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, None),
    (
        "nested 100 deep in chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": [' + b'{"a":' * 100 + b"1" + b"}" * 100 + b"]}]}",
        400,
        None,
    ),
    ("temperature NaN", CMPL, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("temperature inf", CMPL, b'{"prompt": "a", "temperature": Infinity}', 400, "temperature"),
    ("top_p NaN", CMPL, b'{"prompt": "a", "top_p": NaN}', 400, "top_p"),
    ("min_p NaN", CHAT, b'{"messages": [{"role": "user", "content": "a"}], "min_p": NaN}', 400, "min_p"),
    ("presence_penalty NaN", CMPL, b'{"prompt": "a", "presence_penalty": NaN}', 400, "presence_penalty"),
    ("repetition_penalty -inf", CMPL, b'{"prompt": "a", "repetition_penalty": -Infinity}', 400, "repetition_penalty"),
]

CASES = [
    ("n too large", CMPL, {"prompt": "a", "n": 1000}, 400, "n"),
    ("too many stop strings", CMPL, {"prompt": "a", "stop": [f"s{i}" for i in range(40)]}, 400, "stop"),
    ("stop string too long", CHAT, {"messages": [{"role": "user", "content": "a"}], "stop": ["x" * 300]}, 400, "stop"),
    ("too many stop_token_ids", CMPL, {"prompt": "a", "stop_token_ids": list(range(300))}, 400, "stop_token_ids"),
    ("seed beyond 64 bits", CMPL, {"prompt": "a", "seed": 1 << 70}, 400, "seed"),
    ("100,000 stop strings", CMPL, {"prompt": "a", "stop": [f"s{i}" for i in range(100_000)]}, 413, None),
]


def _post(server, path, raw: bytes):
    return httpx.post(
        server.base_url + path,
        content=raw,
        timeout=60,
        headers={"Content-Type": "application/json", **server.headers()},
    )


def _assert_error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("name,path,raw,status,param", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_hostile_bodies(server, name, path, raw, status, param):
    _assert_error(_post(server, path, raw), status, param)


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_unbounded_lists_and_numbers(server, name, path, body, status, param):
    _assert_error(_post(server, path, json.dumps(body).encode()), status, param)


def test_megabyte_prompt_refused_by_characters_before_tokenizing(server):
    """A prompt with more characters than max_model_len tokens can hold: 400 at once, from the
    character bound (the message says characters), for completions and /tokenize alike."""
    prompt = "lorem ipsum " * 5000  # 60,000 characters, under the 64 KiB body limit
    for path, body in (
        (CMPL, {"prompt": prompt}),
        ("/tokenize", {"prompt": prompt}),
        (CHAT, {"messages": [{"role": "user", "content": prompt}]}),
    ):
        r = _post(server, path, json.dumps(body).encode())
        _assert_error(r, 400, None)
        assert "characters" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_long_prompt_with_truncation_tokenizes_only_its_tail(server, tiny_model_dir):
    """truncate_prompt_tokens used to skip the character bound, so any length was tokenized
    whole (on the ingress's loop). Now only the tail that can hold the context is: the
    request is served, and the tokens it keeps are the last ones of the whole prompt, for
    completions and chat alike."""
    from transformers import AutoTokenizer

    from fleetserve.router.api.limits import max_token_chars
    from fleetserve.router.bodies import TAIL_SLACK_TOKENS

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "".join(f"w{i % 97} " for i in range(12_000))[:60_000]  # under the 64 KiB body limit
    assert len(prompt) > (server.config.engine.max_model_len + TAIL_SLACK_TOKENS) * max_token_chars(tok)
    want = tok(prompt, add_special_tokens=True).input_ids[-16:]
    r = _post(
        server,
        CMPL,
        json.dumps(
            {"prompt": prompt, "truncate_prompt_tokens": 16, "max_tokens": 1, "echo": True, "logprobs": 0}
        ).encode(),
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 16
    assert r.json()["choices"][0]["text"].startswith(tok.decode(want))
    r = _post(
        server,
        CHAT,
        json.dumps(
            {"messages": [{"role": "user", "content": prompt}], "truncate_prompt_tokens": 16, "max_tokens": 1}
        ).encode(),
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 16
    server.wait_idle()


def test_body_shorter_than_content_length_times_out_cleanly(server):
    """A client that announces 1000 bytes and sends 10 gets 408 within the body timeout
    (3 s in the test config) instead of holding its connection with no answer."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            (
                f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {server.api_key}\r\nContent-Length: 1000\r\n\r\n"
                '{"prompt":'
            ).encode()
        )
        start = time.monotonic()
        reply = s.recv(65536).decode(errors="replace")
        assert time.monotonic() - start < 20
        while "}}" not in reply:  # the body may come in a packet of its own
            more = s.recv(65536).decode(errors="replace")
            if not more:
                break
            reply += more
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    assert "did not arrive" in reply


# -- gRPC ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


def _meta(server):
    return (("application", server.app), ("authorization", f"Bearer {server.api_key}"))


def _grpc_code(channel, server, request) -> grpc.StatusCode:
    stub = pb_grpc.FleetServeStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, metadata=_meta(server), timeout=60))
    return e.value.code(), e.value.details()


def test_grpc_huge_n_and_stop_lists_under_load_are_refused(channel, server):
    """The original wedge over gRPC: n=1000 or 100,000 stop strings, sent while other streams
    run. Each is INVALID_ARGUMENT; the streams finish; the replicas serve on, nothing leaks."""
    stub = pb_grpc.FleetServeStub(channel)
    ok = pb.GenerateRequest(prompt="keep going", sampling_params=pb.SamplingParams(max_tokens=40, ignore_eos=True))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        load = [pool.submit(lambda: list(stub.Generate(ok, metadata=_meta(server), timeout=120))) for _ in range(4)]
        time.sleep(0.5)
        for sp in (
            pb.SamplingParams(n=1000, max_tokens=4),
            pb.SamplingParams(stop=[f"never-{i}" for i in range(100_000)], max_tokens=4),
        ):
            code, details = _grpc_code(channel, server, pb.GenerateRequest(prompt="x", sampling_params=sp))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "sampling_params." in details
        for f in load:
            assert f.result()[-1].completion_tokens == 40
    for _ in range(4):  # both replicas still take work (the request router spreads them)
        msgs = list(stub.Generate(ok, metadata=_meta(server), timeout=60))
        assert msgs[-1].completion_tokens == 40
    server.wait_idle()


def test_grpc_nan_and_garbage_are_invalid_argument(channel, server):
    nan = pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(temperature=float("nan")))
    code, details = _grpc_code(channel, server, nan)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in details
    inf = pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(top_p=float("inf")))
    assert _grpc_code(channel, server, inf)[0] == grpc.StatusCode.INVALID_ARGUMENT
    raw = channel.unary_stream(
        "/fleetserve.v1.FleetServe/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    for garbage in (b"\xff\xff\xff\xff", b"\x12\x05\xff\xfe\xfd\xfc\xfb"):  # junk; bad UTF-8 prompt
        with pytest.raises(grpc.RpcError) as e:
            list(raw(garbage, metadata=_meta(server), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_grpc_client_request_id_is_echoed_but_not_used_by_the_engine(channel, server):
    """Two concurrent calls with the same client request_id both complete (the engine's ids
    are the server's own), and each sees its own id echoed."""
    stub = pb_grpc.FleetServeStub(channel)
    req = pb.GenerateRequest(
        prompt="same id", request_id="mine", sampling_params=pb.SamplingParams(max_tokens=8, ignore_eos=True)
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: list(stub.Generate(req, metadata=_meta(server), timeout=60)), range(2)))
    for msgs in results:
        assert msgs[-1].completion_tokens == 8 and {m.request_id for m in msgs} == {"mine"}
    server.wait_idle()


def test_serves_and_no_leaks_after_hostile_input(server):
    for _, path, raw, *_ in RAW_CASES:
        _post(server, path, raw)
    r = httpx.post(
        server.base_url + CMPL,
        headers=server.headers(),
        timeout=60,
        json={"prompt": "still alive?", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    health = httpx.get(server.base_url + "/health", headers=server.headers(), timeout=30)
    assert health.status_code == 200 and health.json()["num_replicas"] == 2
    server.wait_idle()
