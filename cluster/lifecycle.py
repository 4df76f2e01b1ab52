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
import signal
import threading
from typing import Optional

from fleetserve.cluster.config import AppConfig

log = logging.getLogger("fleetserve")

_POLL_S = 0.2


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
            deploy(self.config)
            for line in endpoints(self.config):
                log.info("%s", line)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e
        finally:
            self.done.set()


def run_server(config: AppConfig) -> int:
    """Start, serve until SIGINT/SIGTERM, stop. Returns the process exit code."""
    from fleetserve.cluster.deploy import connect_ray

    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    def install() -> None:
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    install()
    log.info("starting Ray (%s)", config.address or "embedded, local")
    try:
        connect_ray(config)
    except (ConnectionError, RuntimeError, ValueError) as e:  # e.g. no cluster at --address
        log.error("fleetserve serve: cannot start or join Ray: %s", e)
        return 1
    install()
    start = _StartUp(config)
    if not stop.is_set():
        start.start()
        while not start.done.wait(_POLL_S) and not stop.is_set():
            pass
    if not start.done.is_set():
        log.info("%s during start-up: stopping", received[0] if received else "stop")
        _teardown(config, delete_app=start.deploying and bool(config.address))
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


def _report_failure(error: BaseException) -> None:
    from fleetserve.cluster.topology import TopologyError

    if isinstance(error, (TopologyError, ValueError)):
        log.error("fleetserve serve: %s", error)
    else:
        log.error("fleetserve serve: start-up failed: %s: %s", type(error).__name__, error,
                  exc_info=error)


def _teardown(config: AppConfig, delete_app: bool) -> None:
    """Delete the app (replicas stop their engines), then stop or leave Ray.

    With the embedded Ray, `ray.shutdown()` ends Serve's controller and proxy with
    the cluster; `serve.shutdown()` first would kill the controller in the middle
    of its own graceful shutdown and make Ray log a failed, retried task."""
    import ray

    if delete_app and ray.is_initialized():
        _delete_app(config)
    ray.shutdown()


def _delete_app(config: AppConfig) -> None:
    from ray import serve

    try:
        serve.delete(config.name)
    except Exception as e:  # noqa: BLE001 - Serve never started, or Ray is going away
        log.debug("serve.delete(%r): %s", config.name, e)
