"""P/D on the real default model (SmolLM2-135M), started as a user would type it:

    fleetserve serve --pd --num-prefill-replicas 1 --num-decode-replicas 1 --kv-connector ray_object_store

(plus ports, a small cache and one thread per engine for CI). Driven with the official
`openai` client: completions and a streamed chat give the greedy text of one engine that
did everything itself (the offline `LLM` on the same model and settings), the decode side
computed at most the last block of each prompt, and afterwards both engines have every
block free and Ctrl-C stops the app cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.pd.conftest import BLOCK, PDServer, free_port, stop_server
from tests.pd.test_pd_e2e import check_usage, client, stream_chat, tokenize

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "smollm2-135m"
N = 10  # output tokens per request
ENGINE = [
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK),
    "--max-model-len",
    "512",
    "--num-gpu-blocks-override",
    "96",
    "--num-threads",
    "1",
]
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Books that had taken a "
    "scribe months to copy could now be printed in days, and their prices fell. Within fifty years, "
    "presses were running in more than two hundred European towns. Describe one consequence.",
    "A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for ten "
    "minutes, let it rise for an hour, shape it, let it rise again and bake it in a hot oven "
    "until the crust is brown. Kneading stretches the gluten into long elastic strands, which trap "
    "the gas the yeast makes while the dough rises and give the loaf its open crumb. What happens "
    "if you skip the kneading?",
]
SYSTEM = (
    "You are a careful assistant for a museum of natural history. Answer visitors' questions "
    "about fossils, minerals and the animals on display in plain words, in two sentences."
)


def one_engine():
    """Greedy text of one engine that computes the whole prompt itself."""
    from fleetserve import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", block_size=BLOCK, max_model_len=512, num_gpu_blocks_override=96, num_threads=1)

    def text(ids: list[int]) -> str:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
        return out[0].outputs[0].text

    return text


@pytest.fixture(scope="module")
def pd_cli_server(tmp_path_factory):
    pytest.importorskip("gguf")
    tmp = tmp_path_factory.mktemp("pd-real")
    port, grpc_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-c",
        "from fleetserve.cluster.cli import main; raise SystemExit(main())",
        "serve",
        "--pd",
        "--num-prefill-replicas",
        "1",
        "--num-decode-replicas",
        "1",
        "--kv-connector",
        "ray_object_store",
        "--pd-min-prefill-tokens",
        "32",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        *ENGINE,
    ]
    log_path = tmp / "serve.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = PDServer(port, log_path, grpc_port, app="fleetserve")
    server.model = MODEL
    try:
        reference = one_engine()  # loads while the app starts
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, "server exited:\n" + server.log_tail()
            try:
                r = httpx.get(server.base_url + "/health", timeout=5)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    break  # "ok": both pools' replicas are up ("degraded": the decode pool alone)
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up:\n" + server.log_tail()
            time.sleep(0.5)
    except BaseException:
        stop_server(proc)
        raise
    yield server, reference
    stop_server(proc)
    assert proc.returncode == 0, server.log_tail()


def test_smollm2_pd_completions_and_streamed_chat_equal_one_engine(pd_cli_server):
    server, reference = pd_cli_server
    health = httpx.get(server.base_url + "/health", timeout=10).json()
    assert health["num_replicas"] == 1 and health["prefill"]["num_replicas"] == 1, health
    c = client(server)
    before = server.pd_tokens()
    for prompt in PROMPTS:
        ids = tokenize(server, prompt=prompt)
        assert len(ids) > 2 * BLOCK
        r = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == reference(ids)
        check_usage(r.usage, len(ids))

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How old is the oldest fossil here?"},
    ]
    ids = tokenize(server, messages=messages)
    text, usage, finish = stream_chat(c, MODEL, messages, N)
    assert finish == "length"
    assert text == reference(ids)
    check_usage(usage, len(ids))

    after = server.pd_tokens()
    loaded = after.get("loaded", 0) - before.get("loaded", 0)
    assert loaded >= sum(len(tokenize(server, prompt=p)) for p in PROMPTS) - 2 * 2 * BLOCK
    assert server.pd_paths().get("pd", 0) >= 3
    server.wait_all_free()
