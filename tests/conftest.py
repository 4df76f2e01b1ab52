"""Suite-wide settings. Tests start their own Ray on loopback; Ray 2.60's token
authentication (which writes a token file under $HOME) is off for them, and so are slow
reverse-DNS lookups of loopback (RES_OPTIONS below)."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# torch's TCPStore (the P2P KV connector's rendezvous and outboxes, gloo's TP groups) formats
# each socket's peer for its log with getnameinfo, which asks DNS for the name of the
# IPv4-mapped ::ffff:127.0.0.1 (/etc/hosts lists only 127.0.0.1). The sandboxes this suite
# runs in answer about one such query in 25 not at all, and glibc's default 5 s timeout then
# stalls that connection by 5 s (the suite makes hundreds of them). One try of 1 s instead: a
# lost lookup costs 1 s, and torch logs the address instead of a name. This process and every
# one it starts (Ray's, the servers', the engine cores) read it; no test resolves a name
# through DNS.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import pytest  # noqa: E402


# A tiny random Llama, shared by every folder's tests (replica, kv_transfer, ...).
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2
    )


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


# Ending the test process. One clean-clone run of the whole suite (2026-11-28, Zen 3) printed
# "931 passed" and then died with SIGSEGV in the interpreter's shutdown (exit 139: CI red with
# every test green); the run before it, with the same tests, exited 0. What crashed was not
# found: the process by then holds native state that outlives the tests (torch's thread pools
# and the CPU kernels of in-process engines, Ray's core worker after `ray.shutdown()`, gloo
# groups). Once pytest has reported and every plugin has finished, the process exits with
# pytest's own status without running that finalization: failures still fail, nothing is
# hidden from the report. Servers and Ray instances the tests started are stopped by their
# fixtures before this; Ray's processes end with their parent anyway (PR_SET_PDEATHSIG).
_SESSION: list = []


def pytest_sessionstart(session):
    _SESSION.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys

    if not _SESSION or os.environ.get("FLEETSERVE_TEST_NORMAL_EXIT") == "1":
        return
    status = int(_SESSION[0].exitstatus)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
