"""A P/D app (1 prefill + 1 decode replica of a tiny model, prefix routing from KV events)
served by `fleetserve serve --config` in a subprocess: its own embedded Ray, so it never
meets the router suite's Ray instance, and the test drives it as a user would (HTTP, the
official openai client, /metrics). Faults kill replica processes by pid (psutil)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.fresh_metrics import fresh_metrics_text
from tests.router.conftest import free_port  # noqa: F401 (one for all suites; tests import it from here)

APP = "fleetserve-pd-test"
BLOCK = 16
REUSE_BLOCK = 8  # reuse_server's engines: a block size other than the default
REUSE_LEN = 2048  # reuse_server's max_model_len: room for a long stream that keeps a replica busy
MAX_TOKENS = 8
# The families this ingress counts itself (router/metrics.py, part 2: P/D, reuse, routing and
# migration counts, read or counted before the response they count ends): a scrape has them
# current, with no wait for the engine replicas' next reports.
INGRESS_FAMILIES = ("fleetserve:pd_", "fleetserve:prefix_reuse_", "fleetserve:router_", "fleetserve:request_migration")


@pytest.fixture(scope="package")
def local_ray():
    """One in-process Ray for this folder's tests of the P/D and reuse flows on local pools
    (test_pd_pressure.py, test_reuse_migration.py): up at the first that asks, down after the
    folder's last test, instead of a start per module (seconds each, tens on a loaded
    machine). The apps started by `fleetserve serve` run their own embedded Ray."""
    from tests.pd.local_pools import local_ray_session

    yield from local_ray_session()


@pytest.fixture(scope="session")
def pd_model_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-pd"))


@pytest.fixture(scope="session")
def pd_lora_dir(pd_model_dir, tmp_path_factory):
    """A LoRA adapter of the P/D model, which pd_server's pools both hold as `tiny-lora`."""
    from fleetserve.replica.testing import make_tiny_lora

    return make_tiny_lora(pd_model_dir, tmp_path_factory.mktemp("pd-lora") / "lora", seed=5)


class PDServer:
    def __init__(self, port: int, log_path, grpc_port: int = 0, app: str = APP) -> None:
        self.base_url = f"http://127.0.0.1:{port}"
        self.grpc_target = f"127.0.0.1:{grpc_port}"
        self.app = app
        self.log_path = log_path
        self.model = "tiny"

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:]

    def metrics(self) -> list:
        """/metrics with the replicas' reports made after this call began (tests.fresh_metrics)."""
        return list(text_string_to_metric_families(fresh_metrics_text(self.base_url)))

    def samples(self, name: str) -> list:
        """`name`'s samples as of now: a family the ingress counts itself from any scrape, an
        engine's from reports made after this call began (a wait of up to a report interval)."""
        if name.startswith(INGRESS_FAMILIES):
            r = httpx.get(self.base_url + "/metrics", timeout=30)
            assert r.status_code == 200, r.text
            families = list(text_string_to_metric_families(r.text))
        else:
            families = self.metrics()
        return [s for fam in families if fam.name == name for s in fam.samples]

    def pd_tokens(self) -> dict[str, float]:
        return {
            s.labels["source"]: s.value
            for s in self.samples("fleetserve:pd_decode_prompt_tokens")
            if s.name.endswith("_total")
        }

    def pd_paths(self) -> dict[str, float]:
        return {s.labels["path"]: s.value for s in self.samples("fleetserve:pd_requests") if s.name.endswith("_total")}

    def kill(self, pool: str) -> int:
        """SIGKILL the (one) replica process of `pool`; returns its pid."""
        pids = self.replica_pids(pool)
        assert len(pids) == 1, (pool, pids)
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def wait_replaced(self, pool: str, old_pid: int, timeout_s: float = 180.0) -> None:
        deadline = time.time() + timeout_s
        while True:
            pids = self.replica_pids(pool)
            if pids and old_pid not in pids:
                try:
                    self.wait_all_free(timeout_s=5)
                    return
                except AssertionError:
                    pass
            if time.time() > deadline:
                raise AssertionError(f"{pool} replica not replaced: {pids}\n{self.log_tail()}")
            time.sleep(1)

    def replica_pids(self, pool: str) -> list[int]:
        """Processes of this app's `pool` deployment (Ray titles them ray::ServeReplica:...)."""
        tag = f"ServeReplica:{APP}:{pool}"
        out = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if tag in cmd:
                out.append(p.pid)
        return out

    def wait_all_free(self, timeout_s: float = 30.0) -> None:
        """Both replicas up, nothing running or waiting, every block free."""
        deadline = time.time() + timeout_s
        while True:
            try:
                fams = {f.name: f for f in self.metrics()}
                usage = [s.value for s in fams["vllm:kv_cache_usage_perc"].samples]
                busy = [
                    s.value for n in ("vllm:num_requests_running", "vllm:num_requests_waiting") for s in fams[n].samples
                ]
                if len(usage) == 2 and all(u == 0 for u in usage) and not any(busy):
                    return
                state = (usage, busy)
            except (AssertionError, KeyError, httpx.HTTPError) as e:
                state = repr(e)
            if time.time() > deadline:
                raise AssertionError(f"replicas not idle with all blocks free: {state}")
            time.sleep(0.3)


def start_server(tmp_path, model_dir, pd: dict, name: str = APP, **top):
    """Start the app; once more if its embedded Ray timed out starting (a loaded machine).
    `engine`: fields over the tiny engine's; any other keyword: a top-level app field."""
    try:
        return _start_server(tmp_path, model_dir, pd, name, **top)
    except AssertionError as e:
        if "timed out during startup" not in str(e):
            raise
        return _start_server(tmp_path, model_dir, pd, name, **top)


def _start_server(tmp_path, model_dir, pd: dict, name: str = APP, **top):
    port, grpc_port = free_port(), free_port()
    config = {
        "name": name,
        "engine": {
            "model": str(model_dir),
            "served_model_name": "tiny",
            "max_model_len": 256,
            "num_gpu_blocks_override": 96,
            "max_num_seqs": 8,
            "num_threads": 1,
            "block_size": BLOCK,
            "dtype": "float32",
            **top.pop("engine", {}),
        },
        "num_cpus_per_replica": 0,
        "routing_policy": "prefix_aware",
        "http": {"port": port},
        "grpc": {"port": grpc_port},
        "pd": pd,
        # Replicas report their metrics twice a second (1 s by default): a test reading an
        # engine's counts (tests.fresh_metrics) waits for reports made after its requests.
        "reliability": {"metrics_report_interval_s": 0.5, **top.pop("reliability", {})},
        **top,
    }
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-c",
        "from fleetserve.cluster.cli import main; raise SystemExit(main())",
        "serve",
        "--config",
        str(path),
    ]
    log = open(log_path, "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = PDServer(port, log_path, grpc_port, name)
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise AssertionError("server exited:\n" + server.log_tail())
        try:
            r = httpx.get(server.base_url + "/health", timeout=5)
            # 200 with "degraded" while the prefill pool is still loading (the decode pool
            # alone decides 200): every replica of both pools must be up before tests start.
            if r.status_code == 200 and r.json().get("status") == "ok":
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            stop_server(proc)
            raise AssertionError("server did not come up:\n" + server.log_tail())
        time.sleep(0.5)
    return proc, server


def stop_server(proc) -> None:
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: the CLI shuts Serve and Ray down
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def pd_traces():
    """The OTLP/HTTP receiver pd_server sends its traces to (tests/otlp_receiver.py)."""
    from tests.otlp_receiver import OTLPReceiver

    with OTLPReceiver(port=free_port()) as rx:
        yield rx


@pytest.fixture(scope="module")
def pd_server(tmp_path_factory, pd_model_dir, pd_lora_dir, pd_traces):
    tmp = tmp_path_factory.mktemp("pd-app")
    proc, server = start_server(
        tmp,
        pd_model_dir,
        engine={"lora_modules": [f"tiny-lora={pd_lora_dir}"]},
        # every request traced; --enable-log-requests: the replicas log each one's phases
        tracing={"otlp_traces_endpoint": pd_traces.endpoint},
        enable_log_requests=True,
        pd={
            "enabled": True,
            "connector": "ray_object_store",
            # 60 s: an engine's first transfer also connects its engine-core process to Ray and
            # starts the KV owner actor (tens of seconds on a loaded 2-core machine).
            "min_prefill_tokens": 32,
            "kv_lease_s": 60.0,
            "kv_load_timeout_s": 60.0,
        },
    )
    server.traces = pd_traces
    yield server
    stop_server(proc)


@pytest.fixture(scope="module")
def slow_load_server(tmp_path_factory, pd_model_dir):
    """Every KV fetch on the decode side is held back 4 s, past its 3 s deadline: every
    load times out (the decode engine's policy: fail, so the router recomputes). The 3 s
    in WAITING_FOR_REMOTE_KVS are long enough for a test to see them in /metrics."""
    tmp = tmp_path_factory.mktemp("pd-slow-app")
    proc, server = start_server(
        tmp,
        pd_model_dir,
        {
            "enabled": True,
            "connector": "FaultInjectionConnector",
            "kv_connector_extra_config": {"inner": "RayObjectStoreConnector", "faults": {"delay_s": 4.0}},
            "min_prefill_tokens": 32,
            "kv_lease_s": 10.0,
            "kv_load_timeout_s": 3.0,
        },
    )
    yield server
    stop_server(proc)


@pytest.fixture(scope="module")
def reuse_server(tmp_path_factory, pd_model_dir):
    """Colocated: 2 replicas, precise prefix routing, cluster reuse over the object store;
    a replica one request busier than the other counts as overloaded. The engines hash
    their blocks with sha256 in blocks of REUSE_BLOCK tokens (neither is the default): the
    router must take both from the engines' info to find a holder in its index."""
    tmp = tmp_path_factory.mktemp("reuse-app")
    proc, server = start_server(
        tmp,
        pd_model_dir,
        {"enabled": False},
        num_replicas=2,
        engine={
            "prefix_caching_hash_algo": "sha256",
            "block_size": REUSE_BLOCK,
            "max_model_len": REUSE_LEN,
            "num_gpu_blocks_override": 3 * REUSE_LEN // REUSE_BLOCK,
        },
        routing={"imbalance_threshold": 1, "stats_period_s": 0.2},
        # 60 s: the first transfer of an engine connects its core
        # process to Ray (tens of seconds on a loaded 2-core machine)
        cluster_reuse={"enabled": True, "min_tokens": 32, "kv_load_timeout_s": 60.0},
    )
    yield server
    stop_server(proc)


@pytest.fixture(scope="session")
def colocated(pd_model_dir, pd_lora_dir):
    """Greedy text of one engine doing prefill and decode itself (same detokenizer);
    `lora=True`: with pd_server's adapter."""
    from fleetserve import LLM, LoRARequest, SamplingParams

    llm = LLM(
        str(pd_model_dir),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=256,
        num_gpu_blocks_override=96,
        num_threads=1,
        enable_lora=True,
    )
    cache: dict[tuple, str] = {}

    def text(prompt_ids: list[int], n: int = MAX_TOKENS, lora: bool = False) -> str:
        key = (tuple(prompt_ids), n, lora)
        if key not in cache:
            out = llm.generate(
                prompt_ids,
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                use_tqdm=False,
                lora_request=LoRARequest("tiny-lora", 1, str(pd_lora_dir)) if lora else None,
            )
            cache[key] = out[0].outputs[0].text
        return cache[key]

    text.llm = llm  # (embeddings: tests/pd/test_pd_e2e.py)
    yield text
