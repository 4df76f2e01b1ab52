"""`fleetserve serve` as an operator meets it (issue 16): fails fast and says why, stops at
any moment leaving no process (after draining the streams in flight), restarts at once on
the same ports, logs a client's mistake as one INFO line, and exports vLLM's metrics.

All on a tiny random model (replica.testing.make_tiny_llama), one replica, a
subprocess per server; every process a server starts carries a marker in its
environment, so "no process left" is checked over the whole tree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.serve_process import ServeProcess, free_port, leave_time_wait, processes_with
from tests.fresh_metrics import fresh_metrics_text

# vLLM v1's families that dashboards read (vllm/v1/metrics/loggers.py), with their types.
# The parser reports a counter's family without its `_total`.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:time_per_prefill_token_request_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny")))


def tiny_args(
    model: str, port: int, grpc_port: int, *extra: str, max_model_len: int = 256, blocks: int = 64
) -> list[str]:
    return [
        "--model",
        model,
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--num-replicas",
        "1",
        "--max-model-len",
        str(max_model_len),
        "--num-threads",
        "1",
        "--num-gpu-blocks-override",
        str(blocks),
        *extra,
    ]


class Served:
    """One server for the module, (re)started on demand on the same ports. Room for
    DRAIN_STREAMS streams of DRAIN_TOKENS, and a drain that outlasts them (Serve's default
    of 5 s used to cut them)."""

    def __init__(self, model: str, tmp_path) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        (tmp_path / "app.yaml").write_text(
            "reliability: {graceful_shutdown_timeout_s: 120, graceful_shutdown_wait_loop_s: 0.5}\n"
        )
        self.args = tiny_args(
            model, self.port, self.grpc_port, "--config", str(tmp_path / "app.yaml"), max_model_len=1024, blocks=256
        )
        self.tmp_path, self.runs = tmp_path, 0
        self.current: ServeProcess | None = None

    def ensure_running(self) -> ServeProcess:
        if self.current is None or self.current.proc.poll() is not None:
            self.runs += 1
            self.current = ServeProcess(self.tmp_path / f"serve-{self.runs}.log", self.args).start()
            self.current.wait_healthy(self.port)
        return self.current

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    s = Served(tiny_model, tmp_path_factory.mktemp("served"))
    yield s
    if s.current is not None:
        try:
            s.current.stop()
        finally:
            s.current.kill()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400"}  # --help: one line per flag's help
    return subprocess.run(
        [sys.executable, "-m", "fleetserve.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# -- fails fast, says why -------------------------------------------------------------


def test_tp_size_the_model_cannot_split_is_refused_when_arguments_are_read(tiny_model):
    t0 = time.time()
    r = _cli("serve", "--model", tiny_model, "--tensor-parallel-size", "3")
    assert r.returncode == 2, r.stderr
    assert time.time() - t0 < 30
    out = r.stdout + r.stderr
    assert "the sizes this model allows are 1, 2, 4" in out  # 4 heads, 2 KV heads
    assert out.count("tensor_parallel_size=3") == 1 and "Traceback" not in out
    assert "starting Ray" not in out


def test_a_lora_folder_that_is_no_adapter_is_refused_before_ray_starts(tiny_model, tmp_path):
    (tmp_path / "empty").mkdir()
    for value, says in (
        (f"sql={tmp_path / 'missing'}", "no such folder"),
        (f"sql={tmp_path / 'empty'}", "no adapter_config.json"),
        ("sql", "expected name=path"),
    ):
        r = _cli("serve", "--model", tiny_model, "--lora-modules", value)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and says in out and "Traceback" not in out, out
        assert "starting Ray" not in out


@pytest.mark.real_model
def test_default_model_tp_2_names_the_sizes_it_allows():
    pytest.importorskip("gguf")
    r = _cli("serve", "--tensor-parallel-size", "2")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "9 attention heads" in out and "the sizes this model allows are 1, 3" in out, out
    assert "Traceback" not in out


@pytest.mark.slow
def test_impossible_topology_is_refused_in_seconds_with_the_numbers(tiny_model, tmp_path):
    # A joined cluster of 1 CPU; one replica at TP=2 needs 1 + 2 x 1 = 3 CPUs.
    helper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import ray, sys; ray.init(address='local', num_cpus=1, include_dashboard=False, "
            "_node_ip_address='127.0.0.1', log_to_driver=False); "
            "print('GCS', ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    try:
        address = ""
        for line in helper.stdout:
            if line.startswith("GCS "):
                address = line.split()[1]
                break
        assert address, "the helper Ray did not start"
        server = ServeProcess(
            tmp_path / "serve.log",
            tiny_args(tiny_model, free_port(), free_port(), "--address", address, "--tensor-parallel-size", "2"),
        )
        t0 = time.time()
        server.start()
        rc = server.proc.wait(timeout=120)
        elapsed = time.time() - t0
        out = server.log()
        assert rc == 2, out
        assert elapsed < 60, elapsed
        assert "needs 3 CPUs (1 replica x (1 CPU for the replica + 2 tensor-parallel ranks x 1 CPU))" in out, out
        assert "the Ray cluster has 1 CPU available (1 in total)" in out, out
        assert "Traceback" not in out and "Deploying" not in out
    finally:
        helper.stdin.close()
        helper.wait(timeout=60)


@pytest.mark.slow
def test_sigint_during_start_up_stops_and_leaves_no_process(tiny_model, tmp_path):
    server = ServeProcess(tmp_path / "serve.log", tiny_args(tiny_model, free_port(), free_port()))
    server.start()
    try:
        # Mid-deploy: the replicas are being created (the engine loads for many seconds).
        server.wait_for_log("Adding 1 replica to Deployment(name='engine'", timeout_s=240)
        t0 = time.time()
        rc = server.stop()
        assert rc == 0, server.log()[-3000:]
        assert time.time() - t0 < 60
        assert "SIGINT during start-up: stopping" in server.log()
        left = server.leftovers()
        assert not left, [(p.pid, p.name()) for p in left]
    finally:
        server.kill()


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load(tiny_model, tmp_path):
    """`autoscaling` in the app config, on the embedded Ray (slower control loop, no Ray
    metrics: EMBEDDED_RAY_ENV_DEFAULTS): load above target_ongoing_requests brings a second
    replica, and every request is answered in full meanwhile."""
    import concurrent.futures

    (tmp_path / "app.yaml").write_text(
        "autoscaling: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 1,\n"
        "              upscale_delay_s: 0, downscale_delay_s: 600}\n"
    )
    port = free_port()
    server = ServeProcess(
        tmp_path / "serve.log",
        tiny_args(tiny_model, port, free_port(), "--config", str(tmp_path / "app.yaml"), "--num-cpus-per-replica", "0"),
    )
    server.start()
    try:
        server.wait_healthy(port)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["num_replicas"] == 1

        def one(i: int) -> int:
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=120,
                json={"prompt": f"load {i}", "max_tokens": 200, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        deadline, replicas, done = time.time() + 120, 1, []
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            while replicas < 2 and time.time() < deadline:
                done += pool.map(one, range(6))
                replicas = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["num_replicas"]
        assert replicas == 2, server.log()[-3000:]
        assert done and all(n == 200 for n in done)
        assert one(99) == 200
        assert server.stop() == 0
        assert not server.leftovers()
    finally:
        server.kill()


# -- documents itself -----------------------------------------------------------------


def test_help_gives_every_flag_a_sentence_and_its_default():
    from fleetserve.cluster.cli import APP_SKIP, build_parser
    from fleetserve.cluster.cli_engine import schema_fields
    from fleetserve.cluster.config import AppConfig
    from fleetserve.replica.engine.engine_args import EngineArgs

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    for action in flags:
        assert action.help and len(action.help.split()) >= 3, action.option_strings
        assert "[default:" in action.help, action.option_strings
    dests = {a.dest for a in flags}
    missing = ({p for p, _, _ in schema_fields(AppConfig, skip=APP_SKIP)} | set(EngineArgs.model_fields)) - dests
    assert not missing, f"schema fields without a flag: {missing}"
    r = _cli("serve", "--help")
    assert r.returncode == 0
    assert "--tensor-parallel-size" in r.stdout and "{fcfs,priority,fair,sjf}" in r.stdout
    assert "[default: 8000]" in r.stdout and "--generation-config" in r.stdout


# -- logs, metrics, models (one server) ------------------------------------------------


def test_client_errors_log_one_info_line_and_no_traceback(served):
    from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
    from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

    server = served.ensure_running()
    before = len(server.log())
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = pb_grpc.FleetServeStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(
                    pb.GenerateRequest(model="no-such-model", prompt="hi"),
                    metadata=[("application", "fleetserve")],
                    timeout=30,
                )
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    r = httpx.post(served.url("/v1/completions"), json={"model": "no-such-http-model", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404
    ok = httpx.post(served.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200  # still serves
    deadline = time.time() + 20  # worker logs reach the driver's console asynchronously
    while time.time() < deadline:
        new = server.log()[before:]
        if "no-such-model" in new and "no-such-http-model" in new:
            break
        time.sleep(0.5)
    new = server.log()[before:]
    grpc_lines = [line for line in new.splitlines() if "no-such-model" in line]
    http_lines = [line for line in new.splitlines() if "no-such-http-model" in line]
    assert len(grpc_lines) == 1 and " INFO " in grpc_lines[0], new
    assert len(http_lines) == 1 and " INFO " in http_lines[0] and " 404 " in http_lines[0], new
    assert "Traceback" not in new and " ERROR " not in new, new


def test_metrics_have_vllm_names_types_and_labels(served):
    served.ensure_running()
    r = httpx.post(served.url("/v1/completions"), json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    text = fresh_metrics_text(served.url(""))  # replicas report every second: one made after it
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_METRICS.items():
        assert name in families, f"{name} missing"
        assert families[name].type == kind, (name, families[name].type)
    for name in VLLM_METRICS:
        if name == "vllm:cache_config_info":
            continue
        for sample in families[name].samples:
            assert {"model_name", "engine", "replica"} <= set(sample.labels), (name, sample.labels)
    reasons = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert reasons.get("length", 0) >= 1 and {"stop", "abort"} <= set(reasons)


def test_http_and_grpc_bind_only_the_host(served):
    import psutil

    server = served.ensure_running()
    # gRPC listens on an IPv6 socket bound to the IPv4-mapped loopback (::ffff:127.0.0.1).
    listening = {
        (c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in (served.port, served.grpc_port)
    }
    assert listening == {("127.0.0.1", served.port), ("127.0.0.1", served.grpc_port)}, listening
    assert f"gRPC:           127.0.0.1:{served.grpc_port}" in server.log()


def test_embedded_ray_housekeeping_runs_at_the_slower_pace(served):
    """The embedded Ray's controller, GCS and log monitor get EMBEDDED_RAY_ENV_DEFAULTS
    (they leave the engines ~5% of a core more here), and the server still serves."""
    from fleetserve.cluster.deploy import EMBEDDED_RAY_ENV_DEFAULTS

    server = served.ensure_running()
    procs = {" ".join(p.cmdline()): p.environ() for p in processes_with(server.marker)}
    controller = [env for cmd, env in procs.items() if "ServeController" in cmd]
    gcs = [env for cmd, env in procs.items() if "gcs_server" in cmd]
    assert controller and gcs, list(procs)
    for env in controller + gcs:
        for key, value in EMBEDDED_RAY_ENV_DEFAULTS.items():
            assert env.get(key) == value, (key, env.get(key))
    r = httpx.post(
        served.url("/v1/completions"), timeout=60, json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_exported_ray_settings_win_over_the_embedded_defaults(monkeypatch):
    from fleetserve.cluster import deploy

    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    monkeypatch.delenv("RAY_enable_metrics_collection", raising=False)
    env = deploy.embedded_ray_env()
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
    assert env["RAY_enable_metrics_collection"] == "0"


def test_models_reports_when_the_server_started(served):
    served.ensure_running()
    data = httpx.get(served.url("/v1/models"), timeout=30).json()["data"][0]
    assert 1_700_000_000 < data["created"] <= time.time() + 1


# -- starts and stops on demand ----------------------------------------------------------


DRAIN_STREAMS, DRAIN_TOKENS = 4, 600


def _stream(port: int, i: int, progress: dict) -> dict:
    text_chunks, last = 0, None
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=300,
        json={
            "prompt": f"story {i}",
            "max_tokens": DRAIN_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                break
            data = json.loads(last)
            assert "error" not in data, data
            if data.get("usage"):
                return {"usage": data["usage"], "done": False, "chunks": text_chunks}
            text_chunks += 1
            progress[i] = text_chunks
    return {"usage": None, "done": last == "[DONE]", "chunks": text_chunks}


@pytest.mark.slow
def test_sigterm_drains_streams_stops_clean_and_a_restart_on_the_same_ports_works_at_once(served):
    """SIGTERM while streams run (issue 15): the server stops only after every stream
    finished in full, then exits 0 leaving no process; a restart on the same ports works at
    once; a cgroup-wide SIGTERM stops that one promptly too."""
    import concurrent.futures

    server = served.ensure_running()
    # An idle keep-alive connection: the server closes it at shutdown, which leaves the
    # server's side in TIME-WAIT on the HTTP port (what made a restart fail).
    client = httpx.Client(timeout=30)
    assert client.get(served.url("/v1/models")).status_code == 200
    before = len(server.log())
    # SIGTERM to the whole process group, as `timeout` or a supervisor's stop-as-group send
    # it: it used to reach the embedded Ray's GCS and raylet too, and the stop then waited
    # 60 s for the GCS under Serve's delete and logged "Failed to connect to GCS". Only the
    # CLI gets it now (Ray's processes run in a session of their own), as from `kill PID`.
    progress: dict[int, int] = {}
    with concurrent.futures.ThreadPoolExecutor(DRAIN_STREAMS) as pool:
        futures = [pool.submit(_stream, served.port, i, progress) for i in range(DRAIN_STREAMS)]
        while min(progress.get(i, 0) for i in range(DRAIN_STREAMS)) < 3:
            assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
            time.sleep(0.05)
        t0 = time.time()
        os.killpg(server.proc.pid, signal.SIGTERM)
        results = [f.result(timeout=300) for f in futures]
    for r in results:
        assert r["usage"] and r["usage"]["completion_tokens"] == DRAIN_TOKENS, r
    assert server.proc.wait(timeout=180) == 0, server.log()[before:]
    stop_s = time.time() - t0
    stop_log = server.log()[before:]
    assert "Traceback" not in stop_log and " E " not in stop_log and "ERROR" not in stop_log, stop_log
    assert "Ray's GCS or raylet stopped" not in stop_log, stop_log
    assert stop_s < 60, (stop_s, stop_log)
    assert not server.leftovers()
    client.close()
    leave_time_wait(served.port)  # for certain, whatever the timing of the stop above
    t0 = time.time()
    again = served.ensure_running()  # same ports, right away
    assert again is not server and time.time() - t0 < 300
    assert httpx.get(served.url("/v1/models"), timeout=30).status_code == 200
    assert "NoAvailablePortError" not in again.log()
    # A cgroup-wide stop (systemd's default KillMode, a container runtime's kill of every
    # process): SIGTERM reaches every process at once, the GCS and raylet included, so no
    # drain can happen; the CLI stops waiting for one once they are gone (it used to wait
    # 60 s for the GCS inside Serve's delete) and nothing is left behind.
    before = len(again.log())
    t0 = time.time()
    for p in processes_with(again.marker):
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    assert again.proc.wait(timeout=90) == 0, again.log()[before:]
    assert time.time() - t0 < 45, again.log()[before:]
    assert not again.leftovers()


def _ingress_processes(server: ServeProcess) -> list[psutil.Process]:
    """The ingress replica's worker process(es) of this server (Ray titles it
    `ray::ServeReplica:<app>:ingress`)."""
    found = []
    for p in processes_with(server.marker):
        try:
            if any("ServeReplica:" in part and part.endswith(":ingress") for part in p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
def test_a_wedged_ingress_is_replaced_and_its_replacement_binds_the_ports(tiny_model, tmp_path):
    """An ingress that stops answering (SIGSTOP: alive, holding its ports, as one whose loop a
    flood blocked) fails Serve's health checks and is replaced. The replacement starts while
    the old one still listens; it waits for the ports instead of failing its bind (Serve then
    blocked the port for good, and with the range pinned to one port no ingress could ever
    start again: the server was down until restarted). The server serves again, on the same
    ports, and stops cleanly."""
    port, grpc_port = free_port(), free_port()
    (tmp_path / "app.yaml").write_text(
        "reliability: {health_check_period_s: 1, health_check_timeout_s: 2,\n"
        "              graceful_shutdown_timeout_s: 2, graceful_shutdown_wait_loop_s: 0.5}\n"
    )
    server = ServeProcess(
        tmp_path / "serve.log", tiny_args(tiny_model, port, grpc_port, "--config", str(tmp_path / "app.yaml"))
    )
    server.start()
    try:
        server.wait_healthy(port)
        [old] = _ingress_processes(server)
        old.suspend()
        deadline = time.time() + 180
        while True:
            new = [p for p in _ingress_processes(server) if p.pid != old.pid]
            try:
                ok = (
                    new
                    and httpx.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        timeout=10,
                        json={"prompt": "again", "max_tokens": 3, "ignore_eos": True},
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                ok = False
            if ok:
                break
            assert time.time() < deadline, "no working ingress after the old one wedged:\n" + server.log()[-4000:]
            time.sleep(1)
        assert not old.is_running() or old.status() == psutil.STATUS_ZOMBIE  # Serve killed it
        assert "No available ports" not in server.log()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # and gRPC's port too
            grpc.channel_ready_future(channel).result(timeout=30)
        assert server.stop() == 0
        assert not server.leftovers()
    finally:
        try:
            old.resume()
        except Exception:  # noqa: BLE001 - gone already
            pass
        server.kill()
