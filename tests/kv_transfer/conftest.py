import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_layers=2, hidden_size=64,
                           num_heads=4, num_kv_heads=2)
