"""An app whose replicas keep failing to start: `fleetserve serve` says what they died of in
one line per deployment (Serve's own error says only "Failed to update the deployments"),
without a traceback of Serve's internals. A real failed deploy on the suite's Serve: a small
app of its own beside the suite's, whose constructor raises as a replica that cannot read
its weights does."""

from __future__ import annotations

import logging

import httpx
import pytest

BROKEN = "fleetserve-broken-app"


def test_a_failed_deploy_is_reported_with_what_each_deployment_died_of(server, caplog):
    from ray import serve

    from fleetserve.cluster.lifecycle import DeployFailed, _report_failure, deploy_failure_details

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Broken:
        def __init__(self) -> None:
            raise ValueError("corrupt or unreadable weight file /models/x.safetensors")

    try:
        with pytest.raises(RuntimeError, match="Deploying application"):
            serve.run(Broken.bind(), name=BROKEN, route_prefix=None)
        details = deploy_failure_details(BROKEN)
        assert details == [
            "deployment 'Broken': ValueError: corrupt or unreadable weight file /models/x.safetensors"
        ], details
        assert deploy_failure_details("no-such-app") == []
        assert deploy_failure_details(server.app) == []  # a healthy app: nothing failed
        with caplog.at_level(logging.ERROR, logger="fleetserve"):
            _report_failure(DeployFailed(f"Deploying application {BROKEN} failed", details))
        assert "the app failed to start" in caplog.text and details[0] in caplog.text
        assert "Traceback" not in caplog.text
    finally:
        serve.delete(BROKEN)
    # The suite's app was not disturbed.
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=60,
        json={"model": server.model, "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
