"""Engine level: engine A (its own process) prefills a prompt and exports its KV; engine B
loads it and decodes. B's greedy tokens equal one plain engine's, and B computes at most
the prompt's last block."""

from __future__ import annotations

import random
import time

import pytest

from tests.kv_transfer.utils import BLOCK, collect, engine, greedy, hand_off, run, wait_all_free


def storage_cfg(path, role):
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"path": str(path)},
        "kv_load_failure_policy": "fail",
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    eng = engine(tiny_model_dir, core_process=False)
    yield eng
    eng.shutdown()


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(length)] for length in rng.sample(range(9, 60), n)]


@pytest.fixture(scope="module")
def storage_pair(tiny_model_dir, tmp_path_factory):
    """A producer in its own process and a consumer (engine-core thread) on one folder."""
    path = tmp_path_factory.mktemp("kv-store")
    prod = engine(tiny_model_dir, storage_cfg(path, "kv_producer"))
    cons = engine(tiny_model_dir, storage_cfg(path, "kv_consumer"), core_process=False)
    yield prod, cons
    prod.shutdown()
    cons.shutdown()


def test_shared_storage_hand_off_matches_one_engine(storage_pair, reference):
    prod, cons = storage_pair
    for prompt in prompts(3) + [list(range(5, 5 + 4 * BLOCK))]:  # one prompt of whole blocks
        want, _ = run(collect(reference, prompt, greedy(8)))
        got, final, params = run(hand_off(prod, cons, prompt, 8))
        assert got == want
        full = len(prompt) // BLOCK * BLOCK
        assert params["remote_num_tokens"] == full
        computed = len(prompt) - final.num_cached_tokens
        assert computed <= BLOCK, (len(prompt), final.num_cached_tokens)
        assert final.num_remote_tokens == min(full, len(prompt) - 1)
    wait_all_free(prod)
    wait_all_free(cons)


def test_shared_storage_is_a_prefix_cache_across_engines(tiny_model_dir, tmp_path, reference):
    """kv_both without params: whatever one engine computed, another engine loads."""
    a = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_both"), core_process=False)
    try:
        prompt = prompts(1, seed=5)[0]
        want, _ = run(collect(reference, prompt, greedy(6)))
        got_a, first = run(collect(a, prompt, greedy(6)))
        assert got_a == want and first.num_remote_tokens == 0
        wait_all_free(a)
    finally:
        a.shutdown()
    b = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_both"), core_process=False)  # a restart, or another replica
    try:
        got_b, final = run(collect(b, prompt, greedy(6)))
        assert got_b == want
        assert final.num_remote_tokens >= (len(prompt) - 1) // BLOCK * BLOCK - BLOCK
        wait_all_free(b)
    finally:
        b.shutdown()


# ---- Ray object store ---------------------------------------------------------------
def ray_cfg(role, **extra):
    return {
        "kv_connector": "RayObjectStoreConnector",
        "kv_role": role,
        "kv_lease_s": 5.0,
        "kv_load_timeout_s": 10.0,
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": "fail",
    }


@pytest.fixture(scope="module")
def ray_pair(tiny_model_dir, local_ray):
    prod = engine(tiny_model_dir, ray_cfg("kv_producer"))  # its own process, joins this Ray
    cons = engine(tiny_model_dir, ray_cfg("kv_consumer"), core_process=False)
    yield prod, cons
    prod.shutdown()
    cons.shutdown()


def owner_stats(ray):
    from fleetserve.kv_transfer.connectors.ray_owner import get_owner

    # get-or-create: a test run alone may ask before the first export made the owner.
    return ray.get(get_owner(ray, "fleetserve-kv-owner", "fleetserve").stats.remote())


def held_by_owner(ray, oid: str) -> bool:
    from fleetserve.kv_transfer.connectors.ray_owner import get_owner

    return ray.get(get_owner(ray, "fleetserve-kv-owner", "fleetserve").lookup.remote(oid)) is not None


def test_ray_object_store_hand_off_matches_one_engine(ray_pair, reference, local_ray):
    prod, cons = ray_pair
    for prompt in prompts(3, seed=1):
        want, _ = run(collect(reference, prompt, greedy(8)))
        got, final, params = run(hand_off(prod, cons, prompt, 8))
        assert got == want
        assert params["remote_ray_owner"] == "fleetserve-kv-owner"
        assert len(prompt) - final.num_cached_tokens <= BLOCK
        assert final.num_remote_tokens == min(len(prompt) // BLOCK * BLOCK, len(prompt) - 1)
    wait_all_free(prod)
    wait_all_free(cons)
    # Every consumer confirmed: the owner holds nothing any more.
    deadline = time.monotonic() + 10
    while owner_stats(local_ray)["held"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert owner_stats(local_ray)["held"] == 0


def test_ray_lease_ends_an_unclaimed_export(ray_pair, local_ray):
    """A producer's export nobody reads is dropped when its lease (5 s) ends."""
    prod, _ = ray_pair
    _, pfinal = run(
        collect(prod, prompts(1, seed=9)[0], greedy(1), {"do_remote_decode": True, "transfer_id": "unclaimed-1"})
    )
    assert pfinal.kv_transfer_params is not None
    wait_all_free(prod)  # the KV blocks are free at once: the object holds the copy
    deadline = time.monotonic() + 5
    while owner_stats(local_ray)["held"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    expired = owner_stats(local_ray)["expired"]
    assert owner_stats(local_ray)["held"] == 1
    deadline = time.monotonic() + 15
    while owner_stats(local_ray)["held"] and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = owner_stats(local_ray)
    assert stats["held"] == 0 and stats["expired"] == expired + 1


def test_metrics_count_what_moved(storage_pair, reference):
    from prometheus_client.parser import text_string_to_metric_families

    prod, cons = storage_pair
    prompt = prompts(1, seed=3)[0]
    run(hand_off(prod, cons, prompt, 3))
    wait_all_free(prod)

    def samples(eng):
        out = {}
        for fam in text_string_to_metric_families(eng.metrics_text()):
            for s in fam.samples:
                out[(s.name, s.labels.get("source", ""))] = s.value
        return out

    c, p = samples(cons), samples(prod)
    assert c[("vllm:kv_transfer_bytes_received_count", "")] >= 1
    assert c[("vllm:kv_transfer_bytes_received_sum", "")] > 0
    assert c[("vllm:prompt_tokens_by_source_total", "external_kv_transfer")] >= len(prompt) // BLOCK * BLOCK
    assert c[("vllm:prompt_tokens_by_source_total", "local_compute")] >= 1
    assert p[("vllm:kv_transfer_bytes_sent_count", "")] >= 1
    assert c[("vllm:kv_transfer_blocks_held", "")] == 0


def test_ray_producer_killed_before_the_consumer_reads(ray_pair, reference, local_ray, tiny_model_dir):
    """The producer's process owns its exports: killed before the consumer reads, the load
    ends in the right tokens (Ray may still have the object on this node) or a clear error
    (policy "fail"), in time, with every block free. A `durable_owner` producer's export
    is the owner actor's own copy: it outlives the producer and the decode is right."""
    import os
    import signal

    prod, cons = ray_pair
    durable = engine(tiny_model_dir, ray_cfg("kv_producer", durable_owner=True))  # its own process
    try:  # (two prompts: the consumer's prefix cache must not already hold the second)
        for producer, tid, prompt in zip((prod, durable), ("killed-1", "killed-durable-1"), prompts(2, seed=11)):
            want, _ = run(collect(reference, prompt, greedy(6)))
            _, pfinal = run(collect(producer, prompt, greedy(1), {"do_remote_decode": True, "transfer_id": tid}))
            # The export lands just after the reply: wait until the owner holds this one (a
            # count of held exports also moves when an earlier one's release arrives late, and
            # a durable producer killed before its adopt finished leaves nothing to load).
            deadline = time.monotonic() + 10
            while not held_by_owner(local_ray, f"{tid}/r0"):
                assert time.monotonic() < deadline, f"{tid} was never exported"
                time.sleep(0.02)
            os.kill(producer.core_pid, signal.SIGKILL)
            t0 = time.monotonic()
            tokens, final = run(collect(cons, prompt, greedy(6), pfinal.kv_transfer_params))
            if producer is durable:
                assert tokens == want and final.num_remote_tokens > 0
            else:  # Ray may still serve the object from this node's store for a while
                assert tokens == want or (final.outputs[0].finish_reason == "error" and tokens == [])
                assert time.monotonic() - t0 < 10 + 5  # kv_load_timeout_s + slack
            wait_all_free(cons)
    finally:
        durable.shutdown()


# ---- torch.distributed point to point ----------------------------------------------
def test_p2p_hand_off_matches_one_engine(tiny_model_dir, local_ray, reference):
    cfg = {
        "kv_connector": "P2PConnector",
        "kv_role": "kv_both",
        "kv_load_timeout_s": 20.0,
        "kv_connector_extra_config": {"host": "127.0.0.1"},
        "kv_load_failure_policy": "fail",
    }
    prod = engine(tiny_model_dir, cfg)  # its own process
    # No local prefix cache on the consumer: a repeated prompt must go to the producer again.
    cons = engine(tiny_model_dir, cfg, core_process=False, enable_prefix_caching=False)
    try:
        for prompt in prompts(2, seed=4):
            want, _ = run(collect(reference, prompt, greedy(6)))
            got, final, _ = run(hand_off(prod, cons, prompt, 6))
            assert got == want
            assert final.num_remote_tokens == min(len(prompt) // BLOCK * BLOCK, len(prompt) - 1)
        # A transfer the producer does not hold (taken already): a clear error, in time.
        _, pfinal = run(
            collect(prod, prompts(1, seed=8)[0], greedy(1), {"do_remote_decode": True, "transfer_id": "once"})
        )
        params = pfinal.kv_transfer_params
        run(collect(cons, prompts(1, seed=8)[0], greedy(2), params))
        t0 = time.monotonic()
        tokens, again = run(collect(cons, prompts(1, seed=8)[0], greedy(2), params))
        assert again.outputs[0].finish_reason == "error" and tokens == []
        assert time.monotonic() - t0 < 5  # the producer says "taken" at once (not the deadline)
        wait_all_free(prod)
        wait_all_free(cons)
        # The producer dies before the consumer reads: a clear error within the deadline.
        import os
        import signal

        _, pfinal = run(
            collect(prod, prompts(1, seed=12)[0], greedy(1), {"do_remote_decode": True, "transfer_id": "killed-2"})
        )
        os.kill(prod.core_pid, signal.SIGKILL)
        t0 = time.monotonic()
        tokens, final = run(collect(cons, prompts(1, seed=12)[0], greedy(2), pfinal.kv_transfer_params))
        assert final.outputs[0].finish_reason == "error" and tokens == []
        # Not the whole 20 s deadline, nor TCPStore's retries (8.1 s in CI once): refused
        # at once, or given up after CONNECT_TIMEOUT_S when the dying socket still accepts.
        from fleetserve.kv_transfer.connectors.p2p_net import CONNECT_TIMEOUT_S

        print(f"dead producer: load failed after {time.monotonic() - t0:.1f} s")
        assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 3
        wait_all_free(cons)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_the_replica_gives_the_worker_half_its_thread_initializer(tiny_model_dir, tmp_path):
    """The worker half's copy threads run the replica's initializer first
    (replica.worker.omp_bind.one_core_per_thread: kv_transfer itself never calls into OpenMP),
    so their torch ops run on one core while the engine's thread keeps its own setting."""
    import torch

    from fleetserve.replica.worker.omp_bind import one_core_per_thread

    eng = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_both"), core_process=False)
    try:
        half = eng.core.executor.worker.kv_connector.half
        assert half._thread_initializer is one_core_per_thread
        assert half._pool.submit(torch.get_num_threads).result() == 1
        assert half._copy_pool.submit(torch.get_num_threads).result() == 1
    finally:
        eng.shutdown()


# ---- layer-wise hooks ------------------------------------------------------------------
def test_layerwise_save_copies_each_layer_during_the_prefill_forward(tiny_model_dir, tmp_path, reference):
    """`layerwise_save`: the model calls save_kv_layer after every layer of the forward that
    computes the end of a hand-off's prompt; the export leaves when that forward ends and the
    producer frees its blocks at once. The consumer's tokens equal one engine's."""
    cfg = storage_cfg(tmp_path, "kv_producer")
    cfg["kv_connector_extra_config"]["layerwise_save"] = True
    prod = engine(tiny_model_dir, cfg, core_process=False)
    cons = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_consumer"), core_process=False)
    try:
        worker = prod.core.executor.worker
        assert worker.runner.kv_hooks is worker.kv_connector  # hooked in: the connector asked
        assert cons.core.executor.worker.runner.kv_hooks is None  # no per-layer calls
        half = worker.kv_connector.half
        seen: list[tuple[int, str]] = []
        real = half.save_kv_layer

        def spy(layer, kv_layer, md):
            seen.extend((layer, spec.req_id) for spec, *_ in half._layer_saves)
            real(layer, kv_layer, md)

        half.save_kv_layer = spy
        num_layers = len(worker.runner.kv_caches)
        for prompt in prompts(2, seed=6):
            seen.clear()
            want, _ = run(collect(reference, prompt, greedy(6)))
            got, final, params = run(hand_off(prod, cons, prompt, 6))
            assert got == want
            assert len(prompt) - final.num_cached_tokens <= BLOCK
            assert final.num_remote_tokens == min(len(prompt) // BLOCK * BLOCK, len(prompt) - 1)
            assert [layer for layer, _ in seen] == list(range(num_layers))  # one save per layer
            assert not half._layer_saves  # wait_for_save closed them at the forward's end
            wait_all_free(prod, 2.0)  # no delay_free: nothing waits for a copy-out step
        wait_all_free(cons)
    finally:
        prod.shutdown()
        cons.shutdown()


# ---- a hand-off to a consumer that caches a prefix of the prompt ------------------------
@pytest.mark.parametrize("kind", ["storage", "ray", "p2p"])
def test_hand_off_to_a_consumer_caching_a_prefix_loads_only_the_rest(
    kind, tiny_model_dir, local_ray, tmp_path, reference
):
    """The consumer already caches the prompt's first blocks (an earlier turn of the chat): it
    asks for the rest only, and the producer's batch (the whole prompt, from block 0) is read
    from that block on. It used to fail every such load (the batch's first key was compared
    with the first key asked for) and recompute: P/D decode replicas with warm caches."""
    if kind == "storage":
        prod_cfg, cons_cfg = storage_cfg(tmp_path, "kv_producer"), storage_cfg(tmp_path, "kv_consumer")
    elif kind == "ray":
        prod_cfg, cons_cfg = ray_cfg("kv_producer"), ray_cfg("kv_consumer")
    else:
        prod_cfg = cons_cfg = {
            "kv_connector": "p2p",
            "kv_role": "kv_both",
            "kv_load_timeout_s": 20.0,
            "kv_connector_extra_config": {"host": "127.0.0.1"},
            "kv_load_failure_policy": "fail",
        }
    prod = engine(tiny_model_dir, prod_cfg, core_process=False)
    cons = engine(tiny_model_dir, cons_cfg, core_process=False)
    try:
        rng = random.Random(21)
        turn1 = [rng.randrange(3, 380) for _ in range(5 * BLOCK + 2)]
        turn2 = turn1 + [rng.randrange(3, 380) for _ in range(4 * BLOCK + 1)]
        run(collect(cons, turn1, greedy(1)))  # computed here: its 5 full blocks are cached
        want, _ = run(collect(reference, turn2, greedy(6)))
        got, final, params = run(hand_off(prod, cons, turn2, 6))
        assert got == want
        cached_here = 5 * BLOCK
        full = len(turn2) // BLOCK * BLOCK
        assert final.num_remote_tokens == full - cached_here  # loaded, not recomputed
        assert final.num_cached_tokens == full
        wait_all_free(prod)
        wait_all_free(cons)
    finally:
        prod.shutdown()
        cons.shutdown()
