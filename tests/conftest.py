"""Suite-wide settings. Tests start their own Ray on loopback; Ray 2.60's token
authentication (which writes a token file under $HOME) is off for them."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402

# A tiny random Llama, shared by every folder's tests (replica, kv_transfer, ...).
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_layers=2, hidden_size=64,
                           num_heads=4, num_kv_heads=2)


def pytest_runtest_setup(item):
    """`real_model` tests need the default model's package (`.ci/run` installs it); where it
    is absent (a bare GPU image, a partial install) they skip, saying why, instead of erroring."""
    if item.get_closest_marker("real_model") is None:
        return
    from fleetserve.replica.model_loader.registry import ModelNotFoundError, resolve_model

    try:
        resolve_model("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(f"real model unavailable: {e}")
