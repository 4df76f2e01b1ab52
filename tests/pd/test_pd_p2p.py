"""P/D end to end over the P2P connector (gloo pulls between the engines' processes, streamed
in chunks): the `openai` client against 1 prefill + 1 decode replica gets what one colocated
engine gives, the decode side computes at most the last block of each prompt, and every
replica ends with all blocks free. (test_pd_e2e.py runs the rest over the Ray object store.)"""

from __future__ import annotations

import random

import pytest

from tests.pd.conftest import BLOCK, MAX_TOKENS, start_server, stop_server
from tests.pd.test_pd_e2e import check_usage, client, completion_equals_colocated, long_prompt, stream_chat, tokenize

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def p2p_server(tmp_path_factory, pd_model_dir):
    proc, server = start_server(
        tmp_path_factory.mktemp("pd-p2p-app"),
        pd_model_dir,
        {
            "enabled": True,
            "connector": "p2p",
            "kv_connector_extra_config": {"host": "127.0.0.1"},
            "min_prefill_tokens": 32,
            "kv_lease_s": 60.0,
            "kv_load_timeout_s": 60.0,
        },
    )
    yield server
    stop_server(proc)


def test_p2p_hand_offs_equal_colocated(p2p_server, colocated):
    rng = random.Random(7)
    before = p2p_server.pd_tokens()
    for _ in range(2):
        completion_equals_colocated(p2p_server, colocated, long_prompt(rng))
    messages = [{"role": "system", "content": long_prompt(rng, 30)}, {"role": "user", "content": "Say something."}]
    ids = tokenize(p2p_server, messages=messages)
    text, usage, finish = stream_chat(client(p2p_server), "tiny", messages, MAX_TOKENS)
    assert finish == "length" and text == colocated(ids)
    check_usage(usage, len(ids))
    after = p2p_server.pd_tokens()
    assert after.get("loaded", 0) - before.get("loaded", 0) >= 3 * 2 * BLOCK
    assert p2p_server.pd_paths().get("pd", 0) >= 3
    p2p_server.wait_all_free()
