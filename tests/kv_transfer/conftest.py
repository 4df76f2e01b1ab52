import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


# A local Ray for the connectors' directory and object store (shared by this folder's modules).
@pytest.fixture(scope="module")
def local_ray():
    import os

    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
        )
    yield ray
    if started:
        ray.shutdown()
