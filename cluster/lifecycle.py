"""`fleetserve serve` from start to stop: start-up that Ctrl-C / SIGTERM can stop at any moment.

    main thread                                  start-up thread
    connect_ray (a signal now is acted on after it)
    waits for: ready, failed, or a signal        check_fits -> start_serve -> deploy
    signal during start-up  -> Ray shut down (the embedded Ray's workers, and the
                               engine-core processes under them, with it)
    signal after ready      -> delete the app, then Ray

Deploying blocks inside Ray Serve for as long as replicas take to load (or forever,
for a placement group that never fits), and Python runs signal handlers only on
the main thread, between bytecodes: so the deploy runs on a thread of its own and
the main thread only waits. `ray.init` itself must run on the main thread: Ray
starts its GCS and raylet with PR_SET_PDEATHSIG, which kills them when the
*thread* that started them ends; it takes a few seconds, after which a pending
stop is acted on. Ray's driver installs a SIGTERM handler of its own (exit), so
ours are installed again after it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Optional

from fleetserve.cluster.config import AppConfig

log = logging.getLogger("fleetserve")

_POLL_S = 0.2
_CONNECT_STOP_WAIT_S = 10.0  # longest a stop waits for ray.init to return
_HEAD_CHECK_S = 0.5  # during a stop's drain, look this often whether Ray's GCS is still there


class _StartUp(threading.Thread):
    def __init__(self, config: AppConfig) -> None:
        super().__init__(name="fleetserve-start", daemon=True)
        self.config = config
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.deploying = False  # Serve was asked to start or deploy: there may be an app to delete

    def run(self) -> None:
        from fleetserve.cluster.deploy import deploy, endpoints, start_serve
        from fleetserve.cluster.topology import check_fits

        try:
            check_fits(self.config)
            self.deploying = True
            start_serve(self.config)
            try:
                deploy(self.config)
            except RuntimeError as e:
                details = deploy_failure_details(self.config.name)
                if not details:
                    raise
                raise DeployFailed(str(e), details) from None
            for line in endpoints(self.config):
                log.info("%s", line)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e
        finally:
            self.done.set()


def run_server(config: AppConfig) -> int:
    """Start, serve until SIGINT/SIGTERM, stop. Returns the process exit code."""
    from fleetserve.cluster.deploy import connect_ray
    from fleetserve.cluster.topology import split_cores

    config = split_cores(config)  # an embedded Ray's replicas share this machine's cores
    stop = threading.Event()
    received: list[str] = []

    connecting = [True]

    def on_signal(signum, _frame) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()
        # In ray.init: joining (nothing of ours to clean up), or a second signal (Ray's
        # start-up hangs): interrupt it now rather than when it returns.
        if connecting[0] and (config.address or len(received) > 1):
            raise KeyboardInterrupt

    def install() -> None:
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGHUP, on_signal)  # the terminal closed: stop as for Ctrl-C

    install()
    log.info(
        "starting Ray (%s)",
        config.address
        or (f"embedded, local; {config.max_engine_replicas} engine replica(s) x {config.cpus_per_replica:g} CPU"),
    )
    watch = _ConnectWatch(connecting)
    try:
        connect_ray(config)
    except KeyboardInterrupt:
        log.info("%s while starting Ray: stopping", received[-1] if received else "SIGINT")
        import ray

        ray.shutdown()
        return 0
    except Exception as e:  # noqa: BLE001 - no cluster at --address, or Ray's own start-up timed out
        log.error("fleetserve serve: cannot start or join Ray: %s: %s", type(e).__name__, e)
        import ray

        ray.shutdown()  # whatever part of an embedded Ray did start
        return 1
    finally:
        connecting[0] = False
        watch.close()
    install()
    start = _StartUp(config)
    if not stop.is_set():
        start.start()
        while not start.done.wait(_POLL_S) and not stop.is_set():
            pass
    if not start.done.is_set():
        log.info("%s during start-up: stopping", received[0] if received else "stop")
        # Drain what is deployed, embedded Ray or not: /health turns green when a replica is
        # up, before serve.run returns, so requests may already be streaming (a SIGTERM from
        # Kubernetes right after its readiness probe passed, or test_drain).
        _teardown(config, delete_app=start.deploying)
        return 0
    if start.error is not None:
        _report_failure(start.error)
        _teardown(config, delete_app=start.deploying)
        return 2 if isinstance(start.error, ValueError) else 1
    if not stop.is_set():
        log.info("ready; Ctrl-C to stop")
        stop.wait()
    log.info("%s: shutting down", received[0] if received else "stop")
    _teardown(config, delete_app=True)
    return 0


class _ConnectWatch:
    """Ray's start-up (or its wait for a GCS at --address) blocks in C++, where no Python
    signal handler runs until it returns (at Ray's own start-up timeout, when it hangs). The
    C-level handler still writes each signal to a wakeup fd at once: this thread reads it and,
    if Ray is still starting `_CONNECT_STOP_WAIT_S` later, exits the process. Ray started its
    GCS and raylet with PR_SET_PDEATHSIG, so they (and any worker under them) end with it."""

    def __init__(self, connecting: list) -> None:
        self._connecting = connecting
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="fleetserve-stop-watch", daemon=True).start()

    def _run(self) -> None:
        try:
            os.read(self._r, 1)  # a signal, or close()'s byte: Ray has started
        finally:
            os.close(self._r)  # owned by this thread: never closed under a pending read
        deadline = time.monotonic() + _CONNECT_STOP_WAIT_S
        while self._connecting[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._connecting[0]:
            log.warning("Ray is still starting %.0f s after the stop: exiting now", _CONNECT_STOP_WAIT_S)
            logging.shutdown()
            os._exit(0)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass  # the pipe is full of signal bytes: the thread is awake already
        os.close(self._w)


class DeployFailed(RuntimeError):
    """Serve gave up on the app: its replicas kept failing to start."""

    def __init__(self, message: str, details: list[str]) -> None:
        super().__init__(message)
        self.details = details


def deploy_failure_details(app_name: str) -> list[str]:
    """What each failed deployment of `app_name` died of: the last line of the exception its
    replicas raised at start-up ("ValueError: ..."), from `serve.status()`. Serve's own
    RuntimeError says only "Failed to update the deployments [...]"."""
    try:
        from ray import serve

        app = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 - Serve is gone: nothing more to say
        return []
    out = []
    for name, dep in app.deployments.items() if app is not None else ():
        status = str(getattr(dep.status, "value", dep.status))
        lines = [line.strip() for line in (dep.message or "").splitlines() if line.strip()]
        if status in ("DEPLOY_FAILED", "UNHEALTHY") and lines:
            out.append(f"deployment {name!r}: {lines[-1]}")
    return out


def _report_failure(error: BaseException) -> None:
    from fleetserve.cluster.topology import TopologyError

    if isinstance(error, (TopologyError, ValueError)):
        log.error("fleetserve serve: %s", error)
    elif isinstance(error, DeployFailed):  # the replicas' own tracebacks are in the log above
        log.error("fleetserve serve: the app failed to start: %s\n  %s", error, "\n  ".join(error.details))
    else:
        log.error("fleetserve serve: start-up failed: %s: %s", type(error).__name__, error, exc_info=error)


def _teardown(config: AppConfig, delete_app: bool) -> None:
    """Delete the app (replicas stop their engines), then stop or leave Ray.

    With the embedded Ray, `ray.shutdown()` ends Serve's controller and proxy with
    the cluster; `serve.shutdown()` first would kill the controller in the middle
    of its own graceful shutdown and make Ray log a failed, retried task."""
    import ray

    if delete_app and ray.is_initialized():
        _delete_app(config)
    ray.shutdown()


def _ray_head_watch():
    """A check that says whether the embedded Ray's head has stopped: its GCS refuses
    connections (on SIGTERM it closes its port at once, while its process lingers for many
    seconds) or its GCS or raylet process has exited. None for a joined cluster."""
    import socket

    try:
        import ray

        node = ray._private.worker._global_node
        procs = getattr(node, "all_processes", None) or {}
        host, port = node.gcs_address.rsplit(":", 1)
    except Exception:  # noqa: BLE001 - Ray's internals moved: no watch, the plain wait
        return None
    head = [
        info.process
        for kind in ("gcs_server", "raylet")
        for info in procs.get(kind, [])
        if getattr(info, "process", None) is not None
    ]
    if not head:
        return None

    def gone() -> bool:
        if any(p.poll() is not None for p in head):
            return True
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # slow or unreachable for a moment: not proof that it is gone

    return gone


def _delete_app(config: AppConfig) -> None:
    from fleetserve.cluster.deploy import delete_and_drain

    # A stop signal sent to every process of a cgroup (systemd's default
    # KillMode=control-group, a container runtime killing all processes) reaches the embedded
    # Ray's GCS and raylet too (a process-group signal no longer does: deploy.py starts them
    # in a session of their own). No drain can happen then, and Serve's delete would wait
    # 60 s for a GCS that is gone: so it runs on a thread, given up on as soon as the GCS
    # refuses connections or either process has exited.
    head_gone = _ray_head_watch()
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            # Also waits for the replicas to finish their in-flight requests (graceful drain,
            # reliability.graceful_shutdown_timeout_s): serve.delete alone returns before.
            delete_and_drain(config)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    worker = threading.Thread(target=run, name="fleetserve-delete", daemon=True)
    worker.start()
    looked = time.monotonic()
    while worker.is_alive():
        worker.join(_POLL_S)
        if not worker.is_alive() or head_gone is None or time.monotonic() - looked < _HEAD_CHECK_S:
            continue
        looked = time.monotonic()
        if head_gone():
            log.warning(
                "Ray's GCS or raylet stopped during the shutdown (the stop signal reached "
                "them too, e.g. a cgroup-wide stop): not waiting to drain %r",
                config.name,
            )
            return
    try:
        if outcome and outcome[0] is not None:
            raise outcome[0]
    except Exception as e:  # noqa: BLE001 - Serve never started, or Ray is going away
        # Said out loud: Ray shuts down next, so streams still running are cut (a drain that
        # failed here is the one way a SIGTERM can end them early).
        log.warning(
            "could not delete %r and wait for its replicas to drain (%s: %s); stopping Ray",
            config.name,
            type(e).__name__,
            e,
        )
