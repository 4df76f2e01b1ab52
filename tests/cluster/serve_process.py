"""`fleetserve serve` as a subprocess, the way a user runs it, for end-to-end tests.

Every process it starts (the CLI, the embedded Ray's GCS and raylet, Serve's actors,
the replicas and their engine-core children) inherits a unique marker in its
environment, so a test can tell whether any of them outlived the stop.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil

from tests.router.conftest import free_port  # noqa: F401 (one for all suites; tests import it from here)

MARKER = "FLEETSERVE_TEST_MARKER"


def leave_time_wait(port: int) -> None:
    """A connection to a listener on `port` that the server side closes first: its
    socket (127.0.0.1:port) stays in TIME-WAIT for a minute, as after a server stops."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen()
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()
    time.sleep(0.05)
    cli.close()
    srv.close()
    time.sleep(0.05)


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARKER) == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class ServeProcess:
    def __init__(self, log_path: Path, args: list[str], env: dict | None = None) -> None:
        self.log_path, self.args = log_path, args
        self.marker = uuid.uuid4().hex
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", MARKER: self.marker, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServeProcess":
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetserve.cluster.cli", "serve", *self.args],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def wait_for_log(self, text: str, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while text not in self.log():
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}):\n{self.log()[-4000:]}"
            assert time.time() < deadline, f"no {text!r} within {timeout_s} s:\n{self.log()[-4000:]}"
            time.sleep(0.2)

    def wait_healthy(self, port: int, timeout_s: float = 300) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}):\n{self.log()[-4000:]}"
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                healthy = False
            # /health turns green a moment before Serve's deploy call returns and the CLI
            # prints the endpoints and "ready": wait for that too, so tests can read the log.
            if healthy and "ready; Ctrl-C to stop" in self.log():
                return
            time.sleep(0.5)
        raise AssertionError(f"not healthy and ready within {timeout_s} s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 90, group: bool = False) -> int:
        """Send `sig` (Ctrl-C by default) and wait for the exit; kill everything on timeout.
        `group`: to the CLI's whole process group, as a terminal's Ctrl-C, `timeout` or a
        supervisor's stop-as-group do."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"did not stop within {timeout_s} s:\n{self.log()[-4000:]}") from None

    def leftovers(self, timeout_s: float = 30) -> list[psutil.Process]:
        """Processes still carrying this run's marker after `timeout_s` (an engine core that was
        loading notices its parent is gone when it next reads its pipe)."""
        deadline = time.time() + timeout_s
        while True:
            left = processes_with(self.marker)
            if not left or time.time() > deadline:
                return left
            time.sleep(0.5)

    def kill(self) -> None:
        """Last resort for a failed test: kill whatever carries the marker."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        for p in processes_with(self.marker):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
