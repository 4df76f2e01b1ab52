"""One Ray + Serve instance for the whole router suite (it takes 10-20 s to start).

The application: a tiny random Llama (replica.testing.make_tiny_llama) on the
real AsyncEngine, 2 replicas, prefix-aware routing, HTTP and gRPC on free
loopback ports, an API key. max_model_len is 2048 so that one request can stream for
about a second: 256 tokens take ~0.15 s on a fast CPU, less than a test needs to
look at a stream it is about to drop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time

import pytest

from fleetserve.replica.testing import CHATML_TEMPLATE

API_KEY = "test-key"
NOTE_TEMPLATE = "{% if note is defined %}{{ '<note>' + note + '</note>' + '\n' }}{% endif %}"
APP = "fleetserve-test"
SECOND_NAME = "tiny-chat"  # --served-model-name tiny tiny-chat (tests/router/test_served_names.py)


# Ports are drawn below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
# 32768-60999 here), where bind(0) picks: an embedded Ray started after the draw binds its
# agents, metrics exporters and workers' servers on such ports and on fixed ones (GCS,
# dashboard, client server, dashboard agent), and took a drawn port twice (the dashboard
# agent's 52365; a random one the ingress then could not bind). Ray's worker ports are
# 10002-19999 and Serve's default direct-ingress ports 30000-31000, so the draw is from
# 20000-29999, each port checked free and handed out once per process.
RAY_FIXED_PORTS = frozenset({6379, 8265, 10001, 52365, 52366})
PORT_RANGE = (20000, 30000)
_issued: set[int] = set()


def free_port() -> int:
    import random

    for _ in range(1000):
        port = random.randrange(*PORT_RANGE)
        if port in _issued:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _issued.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# LoRA adapters every test server holds (tests/router/test_lora_api.py): a and b of ranks 8
# and 4, b on q/v only; --max-loras 1, so requests for both take turns.
LORA_A, LORA_B = "tiny-lora-a", "tiny-lora-b"


@pytest.fixture(scope="session")
def lora_dirs(tiny_model_dir, tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_lora

    root = tmp_path_factory.mktemp("loras")
    return {
        LORA_A: make_tiny_lora(tiny_model_dir, root / "a", seed=1),
        LORA_B: make_tiny_lora(tiny_model_dir, root / "b", r=4, target_modules=("q_proj", "v_proj"), seed=2),
        # loaded at run time by the tests (/v1/load_lora_adapter)
        "c": make_tiny_lora(tiny_model_dir, root / "c", r=2, target_modules=("gate_proj", "o_proj"), seed=3),
    }


# --api-keys-file of the shared server (tests/router/test_tenants_e2e.py): two tenants named by
# their keys, beside the shared API_KEY (whose requests name their tenant by x-tenant-id).
TENANT_KEYS = {"acme": "acme-key", "beta": "beta-key", "slo-strict": "slo-strict-key"}
ACME_MAX_TOKENS = 4
# SLO-aware admission (tests/router/test_slo_e2e.py): only this tenant has a target, 5 ms to the
# first token, which the server's --slo-profile (the calibrated SmolLM2 CPU profile: 32 ms a step
# at least) says no replica can meet; every other tenant's requests are not judged.
SLO_TENANT, SLO_TENANT_TTFT_MS = "slo-strict", 5
SLO_PROFILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "sim",
    "profiles",
    "cpu-amd-epyc-avx2-smollm2-135m-1t.json",
)


@pytest.fixture(scope="session")
def trace_receiver():
    """The OTLP/HTTP receiver the session's server sends its traces to (tests/otlp_receiver.py):
    every request of the router suite is traced, so the suite runs the tracing path throughout
    (tests/router/test_tracing_e2e.py reads the spans)."""
    from tests.otlp_receiver import OTLPReceiver

    with OTLPReceiver(port=free_port()) as rx:
        yield rx


@pytest.fixture(scope="session")
def server(tiny_model_dir, lora_dirs, trace_receiver, tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import connect_ray, deploy, start_serve

    keys = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    keys.write_text(
        f"acme: {{key: {TENANT_KEYS['acme']}, weight: 2, limits: {{max_tokens: {ACME_MAX_TOKENS}}}}}\n"
        f"beta: {{key_sha256: '{hashlib.sha256(TENANT_KEYS['beta'].encode()).hexdigest()}'}}\n"
        f"{SLO_TENANT}: {{key: {TENANT_KEYS[SLO_TENANT]}, slo: {{ttft_ms: {SLO_TENANT_TTFT_MS}}}}}\n"
    )
    config = AppConfig.model_validate(
        {
            "name": APP,
            # --chat-template: the tiny model's own ChatML, plus a line that only a request's
            # chat_template_kwargs turns on (tests/router/test_chat_template.py)
            # float32 on every CPU: the embeddings and LoRA tests compare with HF and PEFT in float32,
            # and `auto` is bfloat16 on a CPU with AVX-512 BF16
            "engine": {
                "model": str(tiny_model_dir),
                "dtype": "float32",
                "served_model_name": ["tiny", SECOND_NAME],
                "max_model_len": 2048,
                "chat_template": NOTE_TEMPLATE + CHATML_TEMPLATE,
                "num_gpu_blocks_override": 160,
                "max_num_seqs": 8,
                "num_threads": 1,
                "max_waiting_requests": 64,
                # Every request of the router tests runs through the fair-share scheduler (one
                # tenant's requests: first come first served, as fcfs).
                "scheduling_policy": "fair",
                "enable_lora": True,
                "lora_modules": [
                    f"{LORA_A}={lora_dirs[LORA_A]}",
                    {"name": LORA_B, "path": str(lora_dirs[LORA_B]), "base_model_name": SECOND_NAME},
                ],
                "max_loras": 1,
                # /v1/load_lora_adapter loads from here only (replica/lora/paths.py)
                "lora_roots": [str(lora_dirs[LORA_A].parent)],
            },
            "num_replicas": 2,
            "routing_policy": "prefix_aware",
            "num_cpus_per_replica": 0,
            "routing": {"imbalance_threshold": 3},
            "http": {"port": free_port(), "max_body_bytes": 64 * 1024},
            "grpc": {"port": free_port()},
            "api_key": API_KEY,
            "api_keys_file": str(keys),
            # Every chat test runs through the reasoning splitter (a no-op for output that does not
            # open with <think>); tests/router/test_reasoning.py forces some that does.
            "reasoning_parser": "qwen3",
            "allow_runtime_lora_updating": True,
            "reliability": {"body_timeout_s": 3},
            "slo": {"profile": SLO_PROFILE},
            "tracing": {"otlp_traces_endpoint": trace_receiver.endpoint},
        }
    )
    connect_ray(config, num_cpus=2, log_to_driver=False)
    start_serve(config)
    deploy(config)
    info = ServerInfo(config)
    info.traces = trace_receiver
    yield info
    serve.shutdown()
    ray.shutdown()


class ServerInfo:
    def __init__(self, config) -> None:
        self.config = config
        self.base_url = f"http://127.0.0.1:{config.http.port}"
        self.grpc_target = f"127.0.0.1:{config.grpc.port}"
        self.model = config.served_model_name
        self.api_key = API_KEY
        self.app = config.name
        self.traces = None  # the OTLPReceiver its traces go to (the server fixture sets it)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def replica_loads(self) -> dict[str, dict]:
        """get_load() of every engine replica, through pinned calls (the ingress's mechanism)."""
        from ray import serve

        from fleetserve.router.routing.registry import get_router
        from fleetserve.router.routing.request_router import TARGET_KWARG

        handle = serve.get_deployment_handle("engine", self.app)

        async def go():
            await handle.get_info.remote()  # creates this process's router
            router = get_router(self.app, "engine")
            out = {}
            for rid in router.replica_ids():
                r = await handle.control.remote("get_load", **{TARGET_KWARG: rid})
                out[r["replica"]] = r["load"]
            return out

        return asyncio.run(go())

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, dict]:
        """Wait until no replica runs, queues or holds KV blocks; the loads (fails on timeout)."""
        deadline = time.time() + timeout_s
        while True:
            loads = self.replica_loads()
            if all(
                load["num_running"] == 0 and load["num_waiting"] == 0 and load["num_free_blocks"] == load["num_blocks"]
                for load in loads.values()
            ):
                return loads
            if time.time() > deadline:
                raise AssertionError(f"replicas not idle (leaked requests or blocks?): {loads}")
            time.sleep(0.2)
