"""The LoRA admin key (router/auth.py): when set, /v1/load_lora_adapter and
/v1/unload_lora_adapter take it and nothing else (not the API key, not an open path), while
every other path keeps its own rule; the key comes from the flag, a file or the environment
and never reaches a Ray runtime_env."""

from __future__ import annotations

import asyncio

import pytest

from fleetserve.router import auth
from fleetserve.router.auth import LORA_ADMIN_KEY_ENV, ApiKeyAuth, resolve_lora_admin_key

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


async def _app(scope, receive, send):  # what the route would answer, when the middleware lets it by
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status(installed: ApiKeyAuth, path: str, authorization=None) -> tuple[int, bytes]:
    """(status, body) of a POST to `path` through the real middleware with `installed`."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"authorization", authorization.encode())] if authorization else [],
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}"}

    async def send(message):
        sent.append(message)

    before = auth._installed
    auth.install(installed)
    try:
        asyncio.run(auth.RequireApiKey(_app)(scope, receive, send))
    finally:
        auth.install(before)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("path", [LOAD, UNLOAD])
def test_the_admin_paths_take_the_admin_key_and_nothing_else(path):
    both = ApiKeyAuth("api", admin_key="adm-KEY")
    assert status(both, path, "Bearer adm-KEY")[0] == 200
    for header in (None, "Bearer api", "Bearer adm-KEY2", "adm-KEY"):
        code, body = status(both, path, header)
        assert code == 401 and b"LoRA admin key" in body and b"adm-KEY" not in body, body
    # The API key still opens the rest, and only it.
    assert status(both, "/v1/completions", "Bearer api")[0] == 200
    assert status(both, "/v1/completions", "Bearer adm-KEY")[0] == 401
    # An admin key without an API key: the admin paths keyed, the others open; an open path
    # list naming the admin paths does not open them.
    admin_only = ApiKeyAuth(None, open_paths=("/health", LOAD, UNLOAD), admin_key="adm-KEY")
    assert status(admin_only, path)[0] == 401
    assert status(admin_only, path, "Bearer adm-KEY")[0] == 200
    assert status(admin_only, "/v1/completions")[0] == 200


@pytest.mark.parametrize("path", [LOAD, UNLOAD])
def test_without_an_admin_key_the_admin_paths_take_the_api_key(path):
    assert status(ApiKeyAuth("api"), path)[0] == 401
    assert status(ApiKeyAuth("api"), path, "Bearer api")[0] == 200
    assert status(ApiKeyAuth(None), path)[0] == 200  # no keys at all: as vLLM


def test_admin_key_from_flag_file_or_env_and_never_in_the_runtime_env(tmp_path, monkeypatch):
    from fleetserve.cluster.deploy import serve_env

    monkeypatch.delenv(LORA_ADMIN_KEY_ENV, raising=False)
    assert resolve_lora_admin_key(None, None) is None
    f = tmp_path / "admin"
    f.write_text("from-file\n")
    assert resolve_lora_admin_key(None, str(f)) == "from-file"
    monkeypatch.setenv(LORA_ADMIN_KEY_ENV, "from-env")
    assert resolve_lora_admin_key(None, None) == "from-env"
    assert resolve_lora_admin_key("flag", str(f)) == "flag"
    with pytest.raises(ValueError, match="lora_admin_key_file"):
        resolve_lora_admin_key(None, str(tmp_path / "missing"))
    assert LORA_ADMIN_KEY_ENV not in serve_env()


def test_the_app_config_carries_the_admin_key_to_the_ingress_and_wants_roots(tiny_model_dir, tmp_path):
    """`lora_admin_key` reaches the ingress's settings (not their repr); run-time updating
    without --lora-roots (or --allow-any-lora-path) is refused at config time."""
    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import ingress_settings

    engine = {"model": str(tiny_model_dir), "enable_lora": True}
    with pytest.raises(ValueError, match="--lora-roots"):
        AppConfig.model_validate({"engine": engine, "allow_runtime_lora_updating": True})
    config = AppConfig.model_validate(
        {
            "engine": {**engine, "lora_roots": [str(tmp_path)], "lora_load_timeout": 7},
            "allow_runtime_lora_updating": True,
            "lora_admin_key": "s3cret",
        }
    )
    settings = ingress_settings(config, (), ())
    assert settings.lora.admin_key == "s3cret" and settings.lora.load_timeout_s == 7
    assert "s3cret" not in repr(settings)
    AppConfig.model_validate({"engine": {**engine, "allow_any_lora_path": True}, "allow_runtime_lora_updating": True})
