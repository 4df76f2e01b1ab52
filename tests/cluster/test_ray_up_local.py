"""cluster/ray-up/onprem.yaml really runs: `ray up` over ssh to this machine, the app
answers the openai client, `ray down`.

What is changed in the file, and why (each substitution is asserted to apply, so the test
fails when the file changes shape):
- provider/auth: this machine (127.0.0.1) over a throw-away sshd on a free loopback port
  (an ssh ProxyCommand reaches it: Ray's ssh has no port option) with a throw-away key;
- the app config mounted: a tiny random model on free ports;
- setup_commands: none. They would `pip install` into the machine's shared Python; the
  rsynced source (~/fleetserve-src, from the file's own file_mounts) is put on PYTHONPATH;
- `ray start`: free ports, its own --temp-dir, loopback, 2 CPUs (other Rays run here).
This sshd's sessions get their own HOME (a temp folder; its .bashrc is Ray's login
environment) and a `ray` whose `stop` stops only this cluster's processes: the file's
`ray stop` (and `ray down`'s) would otherwise kill every Ray on this shared machine.
Run it alone: `flock -x -w 1500 /tmp/fleetserve-heavy.lock python -m pytest -m slow ...`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.k8s_tools import REPO
from tests.router.conftest import free_port  # below the ephemeral range: Ray binds there

PROXY = """import socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while (b := sys.stdin.buffer.read1(65536)):
        s.sendall(b)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while (b := s.recv(65536)):
    sys.stdout.buffer.write(b); sys.stdout.buffer.flush()
"""

# `ray stop` limited to processes of this cluster (every process started through this
# sshd carries FLEETSERVE_RAYUP_TEST=<its folder> in its environment, Ray's workers too).
RAY_SHIM = """#!/bin/bash
if [ "$1" = stop ]; then exec {python} {here}/stop_cluster.py {here}; fi
exec {ray} "$@"
"""
STOP = """import os, signal, sys, time, psutil
me = {os.getpid()} | {q.pid for q in psutil.Process().parents()}  # this `ray stop`'s shell
def ours(p):  # started from this sshd's sessions: the marker is in its environment
    try:
        return p.pid not in me and p.environ().get("FLEETSERVE_RAYUP_TEST") == sys.argv[1]
    except psutil.Error:
        return False
mine = [p for p in psutil.process_iter() if ours(p)]
for p in mine:
    try: p.send_signal(signal.SIGTERM)
    except psutil.Error: pass
gone, alive = psutil.wait_procs(mine, timeout=5)  # gcs_server, raylet and Serve's actors sit out 15 s of SIGTERM
for p in alive:
    try: p.kill()
    except psutil.Error: pass
print(f"stopped {len(mine)} processes of this cluster")
"""


def ensure_sshd() -> str:
    """Path to sshd, installing openssh-server (and rsync, which ray up uses) if absent."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run an sshd (and to apt-get install openssh-server)")
    if not (shutil.which("sshd") or Path("/usr/sbin/sshd").exists()) or not shutil.which("rsync"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        r = subprocess.run(
            "apt-get update -q && apt-get install -y -q openssh-server rsync",
            shell=True,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode:
            pytest.skip(f"could not apt-get install openssh-server rsync: {r.stderr[-400:]}")
    return shutil.which("sshd") or "/usr/sbin/sshd"


def start_sshd(base: Path, home: Path, port: int) -> subprocess.Popen:
    sshd = ensure_sshd()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", base / "key"], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", base / "hostkey"], check=True)
    shutil.copy(base / "key.pub", base / "authorized_keys")
    login = base / "login.sh"
    login.write_text(
        f'#!/bin/bash\nexport HOME={home}\ncd "$HOME"\nexec bash -c "${{SSH_ORIGINAL_COMMAND:-bash -l}}"\n'
    )
    login.chmod(0o755)
    (base / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {base}/hostkey
PidFile {base}/sshd.pid
AuthorizedKeysFile {base}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
ForceCommand {login}
""")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
    proc = subprocess.Popen(
        [sshd, "-D", "-e", "-f", base / "sshd_config"], stdout=open(base / "sshd.log", "w"), stderr=subprocess.STDOUT
    )
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert proc.poll() is None, (base / "sshd.log").read_text()
            time.sleep(0.2)
    proc.kill()
    pytest.skip("sshd did not start: " + (base / "sshd.log").read_text()[-400:])


def replace(text: str, old: str, new: str) -> str:
    assert old in text, f"onprem.yaml changed shape: {old!r} not found in {text!r}"
    return text.replace(old, new)


def cluster_file(base: Path, home: Path, ssh_port: int, app_file: Path, ports: dict) -> Path:
    config = yaml.safe_load((REPO / "cluster" / "ray-up" / "onprem.yaml").read_text())
    config["cluster_name"] = f"fsru-{os.getpid()}"
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {
        "ssh_user": "root",
        "ssh_private_key": str(base / "key"),
        "ssh_proxy_command": f"{sys.executable} {base}/proxy.py 127.0.0.1 {ssh_port}",
    }
    assert config["file_mounts"]["~/fleetserve-src"] == "."
    config["file_mounts"]["~/fleetserve-app.yaml"] = str(app_file)
    assert any("pip install" in c for c in config["setup_commands"])
    config["setup_commands"] = []
    heads = []
    for cmd in config["head_start_ray_commands"]:
        if "ray start --head" in cmd:
            cmd = replace(
                cmd,
                "--port=6379",
                f"--port={ports['gcs']} --temp-dir={base}/r "
                f"--node-ip-address=127.0.0.1 --num-cpus=2 --include-dashboard=true "
                f"--dashboard-port={ports['dashboard']} "
                f"--dashboard-agent-listen-port={ports['agent']} "
                f"--ray-client-server-port={ports['client']} "
                f"--metrics-export-port={ports['metrics']}",
            )
            cmd = replace(cmd, "--dashboard-host=0.0.0.0", "--dashboard-host=127.0.0.1")
        if "serve deploy" in cmd:
            cmd = replace(cmd, "serve deploy ", f"serve deploy -a http://127.0.0.1:{ports['dashboard']} ")
        heads.append(cmd)
    config["head_start_ray_commands"] = heads
    out = base / "onprem-here.yaml"
    out.write_text(yaml.safe_dump(config))
    return out


def prepare_home(base: Path, home: Path) -> None:
    home.mkdir()
    shim = base / "bin"
    shim.mkdir()
    (base / "proxy.py").write_text(PROXY)
    (base / "stop_cluster.py").write_text(STOP)
    pybin = Path(sys.executable).parent
    cache = os.environ.get("FLEETSERVE_CACHE_DIR") or Path.home() / ".cache" / "fleetserve"
    (shim / "ray").write_text(RAY_SHIM.format(python=sys.executable, here=base, ray=pybin / "ray"))
    (shim / "ray").chmod(0o755)
    bashrc = (
        f"export PATH={shim}:{pybin}:$PATH\n"
        f"export PYTHONPATH={home}/fleetserve-src\n"
        "export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0\n"
        f"export FLEETSERVE_RAYUP_TEST={base}\n"
        # the CPU kernels this machine already compiled (not a rebuild in the temp HOME)
        f"export FLEETSERVE_CACHE_DIR={cache}\n"
    )
    (home / ".bashrc").write_text(bashrc)
    (home / ".bash_profile").write_text("source ~/.bashrc\n")


def serve_logs(base: Path) -> str:
    """The tail of the head's Serve logs: why the app is not answering."""
    logs = sorted((base / "r").glob("session_*/logs/serve/*.log"))
    return (
        "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs[-6:])
        or "no Serve logs on the head"
    )


def leftover(base: Path) -> list:
    import psutil

    def ours(p):
        try:
            return p.environ().get("FLEETSERVE_RAYUP_TEST") == str(base) or f"{base}/r" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    return [p for p in psutil.process_iter() if ours(p)]


@pytest.mark.slow
def test_onprem_file_ray_up_serves_and_ray_down(tmp_path):
    import openai
    import psutil

    from fleetserve.replica.testing import make_tiny_llama

    base = Path(tempfile.mkdtemp(prefix="fsru", dir="/tmp"))  # short: Ray's socket paths
    home = base / "h"
    prepare_home(base, home)
    ssh_port = free_port()
    sshd = start_sshd(base, home, ssh_port)
    ports = {k: free_port() for k in ("gcs", "dashboard", "agent", "client", "metrics", "http", "grpc")}
    model = make_tiny_llama(base / "model")
    app = {
        "name": "onprem",
        "engine": {
            "model": str(model),
            "served_model_name": "tiny",
            "max_model_len": 128,
            "num_gpu_blocks_override": 32,
            "max_num_seqs": 4,
            "num_threads": 1,
        },
        "num_replicas": 1,
        "num_cpus_per_replica": 1,
        "api_key": "onprem-key",
        "http": {"host": "127.0.0.1", "port": ports["http"]},
        "grpc": {"port": ports["grpc"]},
    }
    app_file = base / "app.yaml"
    app_file.write_text(yaml.safe_dump(app))
    config = cluster_file(base, home, ssh_port, app_file, ports)
    name = yaml.safe_load(config.read_text())["cluster_name"]
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = open(tmp_path / "ray-up.log", "w+")
    t0 = time.monotonic()

    def stage(what):  # where the time goes, in the log a failure prints
        log.write(f"\n[test] {what} at {time.monotonic() - t0:.0f} s\n")
        log.flush()

    try:
        up = subprocess.run(
            [*ray_cli, "up", "-y", "--no-config-cache", str(config)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
        stage("ray up returned")
        assert up.returncode == 0, (tmp_path / "ray-up.log").read_text()[-4000:]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="onprem-key", max_retries=0, timeout=30
        )
        deadline = time.time() + 480  # a loaded 2-core machine: minutes
        while True:  # serve deploy returns at once; the app then starts
            try:
                models = client.models.list()
                break
            except (openai.APIConnectionError, openai.APIStatusError):
                assert time.time() < deadline, serve_logs(base)
                time.sleep(2)
        stage("app answered")
        assert [m.id for m in models.data] == ["tiny"]
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):  # the app config's own args reached it
            client.with_options(api_key="wrong").models.list()
        # the head ran the file's own start commands on the rsynced source
        assert (home / "fleetserve-serve.yaml").exists()
        assert (home / "fleetserve-src" / "cluster" / "serve_app.py").exists()
    finally:
        down = subprocess.run(
            [*ray_cli, "down", "-y", str(config)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300
        )
        stage("ray down returned")
        print(
            "stages:",
            [line for line in (tmp_path / "ray-up.log").read_text().splitlines() if line.startswith("[test]")],
        )
        stray = leftover(base)
        stray_cmds = []
        for p in stray:  # only this cluster's processes, by pid
            try:
                stray_cmds.append(" ".join(p.cmdline()[:2]))
                p.kill()
            except psutil.Error:
                pass
        sshd.terminate()
        sshd.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)
        for suffix in ("state", "lock"):  # the local provider's record of this cluster
            Path(f"/tmp/ray/cluster-{name}.{suffix}").unlink(missing_ok=True)
    assert down.returncode == 0, (tmp_path / "ray-up.log").read_text()[-3000:]
    assert not stray, f"ray down left {len(stray)} processes: {stray_cmds}"
