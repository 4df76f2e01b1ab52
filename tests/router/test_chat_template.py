"""`--chat-template` and a request's `chat_template_kwargs`, end to end: the router suite's
app runs with `engine.chat_template` (the tiny model's ChatML plus a `<note>` line that only
a request's `note` variable turns on), which travels with the config to the replicas and
reaches the ingress with the tokenizer."""

from __future__ import annotations

import httpx

MESSAGES = [{"role": "user", "content": "hello there"}]


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(
        server.base_url + path, headers=server.headers(), timeout=120, json={"model": server.model, **body}
    )


def test_the_configured_template_renders_and_request_kwargs_reach_it(server):
    plain = post(server, "/tokenize", messages=MESSAGES)
    noted = post(server, "/tokenize", messages=MESSAGES, chat_template_kwargs={"note": "be brief"})
    assert plain.status_code == 200 and noted.status_code == 200, (plain.text, noted.text)
    text = post(server, "/detokenize", tokens=noted.json()["tokens"]).json()["prompt"]
    assert text.startswith("<note>be brief</note>\n<|im_start|>user\nhello there<|im_end|>"), text
    assert (
        post(server, "/detokenize", tokens=plain.json()["tokens"])
        .json()["prompt"]
        .startswith("<|im_start|>user\nhello there")
    )

    r = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, chat_template_kwargs={"note": "be brief"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == noted.json()["count"]
    server.wait_idle()


def test_kwargs_that_would_replace_the_request_s_own_fields_are_refused(server):
    for kwargs in ({"messages": []}, {"add_generation_prompt": False, "note": "x"}):
        r = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, chat_template_kwargs=kwargs)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "chat_template_kwargs" and "may not set" in error["message"], error
    r = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, chat_template_kwargs="note")
    assert r.status_code == 400 and "chat_template_kwargs" in r.text, r.text
    assert post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=2).status_code == 200
    server.wait_idle()


def test_grpc_chat_takes_the_kwargs_as_json_text(server):
    import grpc
    import pytest

    from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
    from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

    meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
    noted = post(server, "/tokenize", messages=MESSAGES, chat_template_kwargs={"note": "be brief"}).json()
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)

        def chat(kwargs: str):
            return list(
                stub.Chat(
                    pb.ChatRequest(
                        messages=[pb.ChatMessage(role="user", content="hello there")],
                        chat_template_kwargs=kwargs,
                        sampling_params=pb.SamplingParams(max_tokens=2, temperature=0.0),
                    ),
                    metadata=meta,
                    timeout=120,
                )
            )

        assert chat('{"note": "be brief"}')[-1].prompt_tokens == noted["count"]
        for bad, says in (
            ("{note", "not valid JSON"),
            ('["note"]', "chat_template_kwargs"),
            ('{"tools": []}', "may not set tools"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                chat(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details(), (
                bad,
                err.value.details(),
            )
    server.wait_idle()


def test_continue_final_message_goes_on_with_the_prefilled_reply(server):
    """vLLM's continue_final_message: the assistant's last message is left open (no end of
    turn), the reply continues it; over HTTP chat, /tokenize and gRPC Chat."""
    import grpc

    from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
    from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

    prefilled = MESSAGES + [{"role": "assistant", "content": "Sure, here it"}]
    opened = post(server, "/tokenize", messages=prefilled, add_generation_prompt=False, continue_final_message=True)
    assert opened.status_code == 200, opened.text
    text = post(server, "/detokenize", tokens=opened.json()["tokens"]).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nSure, here it"), text
    # The prompt is the asked-for reply's start plus the prefill: the model continues it.
    asked = post(server, "/tokenize", messages=MESSAGES).json()["tokens"]
    assert opened.json()["tokens"][: len(asked)] == asked
    r = post(
        server,
        "/v1/chat/completions",
        messages=prefilled,
        add_generation_prompt=False,
        continue_final_message=True,
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == opened.json()["count"]
    plain = post(
        server, "/v1/completions", prompt=opened.json()["tokens"], max_tokens=4, temperature=0, ignore_eos=True
    ).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["message"]["content"] == plain

    # With the generation prompt (the default) it cannot be: 400, then the app serves on.
    refused = post(server, "/v1/chat/completions", messages=prefilled, continue_final_message=True, max_tokens=2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message", refused.text
    meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)
        msgs = list(
            stub.Chat(
                pb.ChatRequest(
                    messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in prefilled],
                    add_generation_prompt=False,
                    continue_final_message=True,
                    sampling_params=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                ),
                metadata=meta,
                timeout=120,
            )
        )
    assert "".join(m.content for m in msgs) == plain
    assert msgs[-1].prompt_tokens == opened.json()["count"]
    server.wait_idle()
