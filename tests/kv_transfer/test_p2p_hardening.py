"""The P2P rendezvous under hostile or broken peers: a client without the cluster's KV secret
is refused (and learns nothing that lets it read or plant KV), a pull id taken and never
asked with blocks no later pull, and a consumer that stalls mid-pull does not hold up
another's. Real worker halves, gloo between two threads of this process, a local Ray for
the directory; raw TCPStore clients play the hostile and the dead peers."""

from __future__ import annotations

import datetime
import json
import logging
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from fleetserve.kv_transfer.base import ConnectorMetadata, KVConnectorRole, SaveSpec
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors import p2p, p2p_auth
from fleetserve.kv_transfer.connectors.p2p_net import PULL_IDS, PULLS, PullRequest
from fleetserve.kv_transfer.factory import build_context
from fleetserve.kv_transfer.keys import chain_keys
from fleetserve.kv_transfer.secret import KV_SECRET_ENV, KV_SECRET_FILE_ENV, ClusterSecret, load_secret
from tests.kv_transfer.test_p2p_groups import BS, CFG, HD, HEADS, LAYERS, NUM_BLOCKS, hand_off, same_blocks

SECRET = "s3cr3t-for-the-kv-tests-0123456789"
OTHER = "another-clusters-secret-0123456789"


def make_half(role: str, secret: str | None, monkeypatch, seed: int, threads: int | None = None):
    """A P2P worker half whose process environment holds `secret` (None: unset)."""
    if secret is None:
        monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(KV_SECRET_ENV, secret)
    extra: dict = {"host": "127.0.0.1"}
    if threads is not None:
        extra["p2p_server_threads"] = threads
    cfg = KVTransferConfig(
        kv_connector="p2p",
        kv_role=role,
        kv_load_timeout_s=20,
        kv_connector_extra_config=extra,
        engine_id=f"hard-{role}-{time.monotonic_ns()}",
    )
    w = p2p.P2PConnector(cfg, KVConnectorRole.WORKER, build_context(cfg, "m", CFG, torch.float32, BS))
    g = torch.Generator().manual_seed(seed)
    w.register_kv_caches([torch.randn((2, HEADS, NUM_BLOCKS, BS, HD), generator=g) for _ in range(LAYERS)])
    return w


@pytest.fixture
def halves(local_ray, monkeypatch):
    made = []

    def make(role, secret, threads=None):
        w = make_half(role, secret, monkeypatch, len(made), threads)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


def export(prod, tid: str, blocks: list[int]) -> None:
    keys = chain_keys(
        prod.ctx.fingerprint, [(hash(tid) + j) % 90 + 1 for j in range(len(blocks) * BS)], BS, len(blocks)
    )
    prod.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("x", tid, blocks, keys, 60)]))
    prod.start_load_kv()
    prod.half.wait_for_exports(30)
    prod.clear_connector_metadata()


def raw_client(prod) -> dist.TCPStore:
    """A plain TCPStore client of the producer's server: what anyone who reaches the port has."""
    store = prod.half.transport.server._store
    return dist.TCPStore(store.host, store.port, is_master=False, timeout=datetime.timedelta(seconds=10))


def holds_no_buffer(w) -> bool:
    """Every staging buffer a consumer took is back in its pool (nothing leaked by a refusal)."""
    return not w.half.staging._in_use


def wait_until(cond, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def request(pid: int, tid: str) -> bytes:
    return json.dumps(
        PullRequest(pid=pid, oid=f"{tid}/r0", backend="gloo", group=None, new=True, stream=False, readers=1)
    ).encode()


def test_a_client_without_the_secret_is_refused(halves, caplog):
    caplog.set_level(logging.DEBUG)
    prod = halves("kv_producer", SECRET)
    server = prod.half.transport.server
    export(prod, "kept", [0, 1, 2])
    # A raw client asks for the export with an unsealed request: refused, counted, nothing
    # answered under its id, the export still held.
    raw = raw_client(prod)
    raw.queue_push(PULLS, request(77, "kept"))
    wait_until(lambda: server.refused >= 1)
    assert not raw.check(["hdr/77"])
    assert prod.half.transport.held() == 1
    # The same request sealed with another cluster's secret: refused too.
    salt = raw.get(p2p_auth.SALT_KEY)[: p2p_auth.SALT_BYTES]
    forged = p2p_auth.StoreAuth(ClusterSecret(OTHER.encode()), salt)
    raw.queue_push(PULLS, forged.seal(PULLS, request(78, "kept")))
    wait_until(lambda: server.refused >= 2)
    assert not raw.check(["hdr/78"]) and prod.half.transport.held() == 1
    # Engines without the secret, or with another one, fail their pulls at once and clearly.
    for n, (secret, says) in enumerate(((None, "requires the cluster's KV secret"), (OTHER, "another KV secret"))):
        cons = halves("kv_consumer", secret)
        t0 = time.monotonic()
        assert hand_off(prod, cons, [f"refused-{n}"], timeout_s=20) == {0, 1, 2}
        assert time.monotonic() - t0 < 15  # (not at the deadline)
        assert says in caplog.text
        assert holds_no_buffer(cons)
    # An engine with the secret still pulls, and what it gets is the producer's blocks.
    cons = halves("kv_consumer", SECRET)
    assert hand_off(prod, cons, ["with-the-secret"]) == set()
    assert same_blocks(prod, cons, [0, 1, 2]) and holds_no_buffer(cons)
    # The secret is nowhere to be read: not in a log line, a repr, or a pickle.
    assert SECRET not in caplog.text and OTHER not in caplog.text
    for obj in (prod.half.transport, server, cons.half.transport.puller, server._secret):
        assert SECRET not in repr(obj) and SECRET not in repr(vars(obj) if hasattr(obj, "__dict__") else obj)
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(server._secret)


def test_a_secret_less_producer_warns_once_and_serves_as_before(halves, caplog):
    from fleetserve.kv_transfer import secret as secret_mod

    secret_mod._warned.discard("the P2P KV server")
    caplog.set_level(logging.WARNING)
    prod, cons = halves("kv_producer", None), halves("kv_consumer", None)
    halves("kv_producer", None)  # a second server in this process: no second warning
    assert hand_off(prod, cons, ["open"]) == set() and same_blocks(prod, cons, [0, 1, 2])
    assert caplog.text.count("runs without a KV secret") == 1
    # A consumer that has a secret does not pull from a producer without one.
    keyed = halves("kv_consumer", SECRET)
    assert hand_off(prod, keyed, ["unkeyed"]) == {0, 1, 2}
    assert "runs without a KV secret; this engine has one" in caplog.text


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_pull_id_taken_and_never_asked_with_blocks_nothing(halves, secret):
    """A consumer that dies between taking its pull's id and asking leaves a gap in the ids;
    the server never waits on an id, so later pulls are served at once."""
    prod, cons = halves("kv_producer", secret), halves("kv_consumer", secret)
    raw = raw_client(prod)
    for _ in range(3):
        raw.add(PULL_IDS, 1)  # taken, never asked with
    for n in range(2):
        t0 = time.monotonic()
        assert hand_off(prod, cons, [f"after-gap-{n}"], timeout_s=15) == set()
        assert time.monotonic() - t0 < 10  # served, not the deadline's recompute
        assert same_blocks(prod, cons, [0, 1, 2])
        for c in cons.half.kv_caches:  # the next pull must write them again
            c[:, :, :3] = -1.0
    raw.add(PULL_IDS, 1)
    assert hand_off(prod, cons, ["after-another-gap"], timeout_s=15) == set()
    assert same_blocks(prod, cons, [0, 1, 2]) and holds_no_buffer(cons)


def test_a_consumer_that_stalls_mid_pull_does_not_hold_up_another(halves):
    """A consumer that asks, gets its header and never answers holds one server thread until
    the server's store timeout (30 s); another consumer's pull meanwhile is served at once:
    it completes while the stalled one is still being waited on."""
    prod, cons = halves("kv_producer", SECRET), halves("kv_consumer", SECRET)
    server = prod.half.transport.server
    export(prod, "stalled", [10, 11])
    raw = raw_client(prod)
    chan = p2p_auth.Channel(raw, p2p_auth.read_salt(raw, load_secret({KV_SECRET_ENV: SECRET}), "test"))
    pid = raw.add(PULL_IDS, 1)
    chan.push(PULLS, request(pid, "stalled"))
    assert chan.take(f"hdr/{pid}").startswith(b"gloo\n")  # the header; then silence
    wait_until(lambda: server.serving == 1)
    t0 = time.monotonic()
    assert hand_off(prod, cons, ["meanwhile"], timeout_s=20) == set()  # < the stalled one's 30 s
    assert same_blocks(prod, cons, [0, 1, 2]) and holds_no_buffer(cons)
    assert server.serving == 1, "the stalled pull should still be waited on"
    assert time.monotonic() - t0 < 20
    # A replay of the stalled pull's request (sealed, but its id was served) is refused.
    refused = server.refused
    chan.push(PULLS, request(pid, "stalled"))
    wait_until(lambda: server.refused == refused + 1)


def test_the_secret_comes_from_one_place_and_is_checked(tmp_path):
    path = tmp_path / "kv.secret"
    path.write_text(SECRET + "\n")
    from_file, from_env = load_secret({KV_SECRET_FILE_ENV: str(path)}), load_secret({KV_SECRET_ENV: SECRET})
    assert from_file is not None and from_env is not None
    assert from_file.mac("x", b"1") == from_env.mac("x", b"1") != from_env.mac("y", b"1")
    assert load_secret({}) is None
    with pytest.raises(ValueError, match="not both"):
        load_secret({KV_SECRET_ENV: SECRET, KV_SECRET_FILE_ENV: str(path)})
    with pytest.raises(ValueError, match="16 to 4096 bytes") as e:
        load_secret({KV_SECRET_ENV: "short"})
    assert "short" not in str(e.value)
    with pytest.raises(ValueError, match="cannot read the KV secret file"):
        load_secret({KV_SECRET_FILE_ENV: str(tmp_path / "missing")})
    assert repr(from_env) == str(from_env) == "ClusterSecret(<redacted>)"


def test_the_launcher_never_copies_the_secret_into_a_runtime_env(monkeypatch, tmp_path):
    """Replicas of a joined cluster get FLEETSERVE_* settings through their Ray runtime_env,
    which Ray shows to anyone who lists actors: the secret stays out (each node's environment
    or a file holds it); the file's path, not a secret, goes along."""
    from fleetserve.cluster.deploy import serve_env

    monkeypatch.setenv(KV_SECRET_ENV, SECRET)
    monkeypatch.setenv(KV_SECRET_FILE_ENV, str(tmp_path / "kv.secret"))
    env = serve_env()
    assert KV_SECRET_ENV not in env and SECRET not in repr(env)
    assert env[KV_SECRET_FILE_ENV] == str(tmp_path / "kv.secret")
