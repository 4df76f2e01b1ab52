import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


# One local Ray for the whole folder (package scope: up at the first test that asks, down
# after the folder's last test). Each start costs seconds (tens on a loaded 2-core machine),
# and ten modules and fixture params here need one. 6 CPUs: the most any test reserves is
# test_tp_transfer.py's engines (TP ranks 1 + 2 + 2, one CPU bundle each). Detached owner
# actors now outlive their module: a test that counts what an owner holds uses one of its own,
# or the default one in test_engine_transfer.py, the first module here to start Ray.
@pytest.fixture(scope="package")
def local_ray():
    import os

    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    for attempt in range(3 if started else 0):  # a loaded machine can miss Ray's 30 s start-up
        try:
            ray.init(
                address="local", num_cpus=6, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
            )
            break
        except Exception:  # noqa: BLE001 - Ray raises a bare Exception here
            ray.shutdown()
            if attempt == 2:
                raise
    yield ray
    if started:
        ray.shutdown()
