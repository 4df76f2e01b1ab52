"""LoRA adapters loaded at run time (replica/lora/loader.py, paths.py, manager.py): a load
runs off the engine's step loop (another request's decoding goes on while the loader is
held), a load past --lora-load-timeout fails and its weights are never installed, every
refused path (outside --lora-roots, a symlink out of them, missing, not a regular file) is
the same message, and an unload wins over a load already under way. Each failure leaves the
engine serving, with every KV block back in the pool.

A slow load is made real by holding the loader function itself (`adapter._read_tensors`,
what reads the weights file) on an event: the tests assert on steps and tokens made while
it is held, not on timings."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import pytest

from fleetserve.replica.lora.paths import LoRAFileError, LoRANotLoadable, LoRAPathPolicy
from fleetserve.scheduler import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
HOLD_S = 60.0  # the held loader lets go by itself after this (a test that failed never hangs)


class HeldLoader:
    """`adapter._read_tensors`, held on `release` until the test lets it go."""

    def __init__(self, monkeypatch) -> None:
        from fleetserve.replica.lora import adapter

        self.entered = threading.Event()
        self.release = threading.Event()
        self.held = False  # True while a read waits on `release`
        self.reads = 0
        read = adapter._read_tensors

        def held_read(path):
            self.reads += 1
            self.held = True
            self.entered.set()
            try:
                self.release.wait(HOLD_S)
            finally:
                self.held = False
            return read(path)

        monkeypatch.setattr(adapter, "_read_tensors", held_read)


def make_engine(tiny_model_dir, roots, **kw):
    from fleetserve.replica.engine.async_engine import AsyncEngine

    return AsyncEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=96,
        num_threads=1,
        enable_lora=True,
        lora_roots=[str(r) for r in roots],
        core_process=False,  # the loader held here is this process's
        **kw,
    )


def runner_of(engine):
    return engine.core.executor.worker.runner


def prepared_of(engine) -> dict:
    return engine.core.executor.worker._prepared_loras


async def collect(engine, rid, lora=None, path=None, sp=SHORT) -> list[int]:
    out = []
    async for o in engine.generate("Hello, world! How are you", sp, rid, lora_name=lora, lora_path=path):
        out += o.outputs[0].token_ids
    return out


async def wait_until(cond, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.01)


def assert_serves_and_no_leak(engine, want_base: list[int]) -> None:
    assert asyncio.run(collect(engine, "after")) == want_base  # the engine serves on, unchanged
    load = engine.get_load()
    assert load["num_free_blocks"] == load["num_blocks"] and load["num_running"] == 0, load


def test_decoding_goes_on_while_an_adapter_loads(tiny_model_dir, tiny_loras, monkeypatch):
    """While the loader reads an adapter (held), a running base-model request keeps getting
    tokens step after step and health stays green (steps go on); once let go, the adapter is
    installed between steps and serves."""
    held = HeldLoader(monkeypatch)
    engine = make_engine(tiny_model_dir, [tiny_loras["a"].parent])
    try:
        want_base = asyncio.run(collect(engine, "base"))

        async def main():
            stream = engine.generate("The quick brown fox", LONG, "long")
            await stream.__anext__()  # decoding
            load = asyncio.ensure_future(engine.add_lora("a", str(tiny_loras["a"])))
            await wait_until(held.entered.is_set, what="the loader to start")
            tokens_while_held = 0
            while tokens_while_held < 20:  # steps made while the loader is held
                out = await asyncio.wait_for(stream.__anext__(), 20)
                assert held.held, "the loader let go before the test did"
                tokens_while_held += len(out.outputs[0].token_ids)
            assert not load.done() and "a" not in engine.lora_keys
            # Health stays green through a long load: the engine keeps making steps.
            await asyncio.sleep(1.5)
            assert held.held
            engine.check_health(stall_timeout_s=1.0)
            held.release.set()
            key = await asyncio.wait_for(load, 30)
            assert engine.lora_keys == {"a": key}
            assert await collect(engine, "with-a", "a") != want_base  # the adapter's tokens
            await stream.aclose()

        asyncio.run(main())
        assert set(runner_of(engine).lora_adapters.values()) == {"a"} and not prepared_of(engine)
        assert_serves_and_no_leak(engine, want_base)
    finally:
        held.release.set()
        engine.shutdown()


def test_a_load_past_its_deadline_fails_and_is_never_installed(tiny_model_dir, tiny_loras, monkeypatch):
    """--lora-load-timeout: a load still reading at its deadline is answered with an error
    then; when the read ends its weights are dropped, never installed; the engine serves on,
    and the same adapter loads fine afterwards."""
    held = HeldLoader(monkeypatch)
    engine = make_engine(tiny_model_dir, [tiny_loras["a"].parent], lora_load_timeout=1.0)
    try:
        want_base = asyncio.run(collect(engine, "base"))

        async def main():
            with pytest.raises(ValueError, match=r"took over 1 s \(--lora-load-timeout\)"):
                await asyncio.wait_for(engine.add_lora("a", str(tiny_loras["a"])), 30)
            assert held.held and "a" not in engine.lora_keys
            assert await collect(engine, "during") == want_base  # serves while the read hangs
            held.release.set()
            await wait_until(lambda: not held.held and not prepared_of(engine), what="the late read to be dropped")
            assert not runner_of(engine).lora_adapters  # never installed
            key = await engine.add_lora("a", str(tiny_loras["a"]))  # a fresh load: fine
            assert engine.lora_keys == {"a": key}

        asyncio.run(main())
        assert held.reads == 2
        assert_serves_and_no_leak(engine, want_base)
    finally:
        held.release.set()
        engine.shutdown()


def refused_paths(tmp_path, tiny_loras) -> tuple:
    """(the root, {what: path}) of paths a root at tmp_path/root must refuse."""
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    shutil.copytree(tiny_loras["b"], outside)
    shutil.copytree(tiny_loras["b"], root / "ok")
    (root / "escape").symlink_to(outside, target_is_directory=True)  # a folder link out of the root
    part = root / "part"  # its weights a link out of the root
    part.mkdir()
    shutil.copy(tiny_loras["b"] / "adapter_config.json", part)
    (part / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    dev = root / "dev"  # its weights a device
    dev.mkdir()
    shutil.copy(tiny_loras["b"] / "adapter_config.json", dev)
    (dev / "adapter_model.safetensors").symlink_to("/dev/zero")
    noweights = root / "noweights"
    noweights.mkdir()
    shutil.copy(tiny_loras["b"] / "adapter_config.json", noweights)
    (root / "file").write_text("not a folder")
    return root, {
        "outside": str(outside),
        "dotdot": str(root / ".." / "outside"),
        "symlink escape": str(root / "escape"),
        "weights link out": str(part),
        "weights a device": str(dev),
        "missing": str(root / "none"),
        "no weights": str(noweights),
        "a file": str(root / "file"),
        "etc": "/etc",
        "relative": "../../../../etc",
    }


def test_policy_refuses_every_escape_and_names_the_reason_for_the_log(tmp_path, tiny_loras):
    from fleetserve.replica.engine.engine_args import EngineArgs

    root, paths = refused_paths(tmp_path, tiny_loras)
    policy = LoRAPathPolicy((os.path.realpath(root),))
    assert policy.resolve(str(root / "ok")) == os.path.realpath(root / "ok")
    for what, path in paths.items():
        with pytest.raises(LoRAFileError):
            policy.resolve(path)
            pytest.fail(f"{what}: {path} was allowed")
    # No roots: loading by path is off, unless --allow-any-lora-path (which still wants
    # regular files); --lora-modules paths are always allowed.
    args = EngineArgs(model="m", lora_modules=[f"cfg={paths['outside']}"])
    with pytest.raises(LoRAFileError, match="--lora-roots"):
        LoRAPathPolicy.from_args(args).resolve(str(root / "ok"))
    assert LoRAPathPolicy.from_args(args).resolve(paths["outside"]) == paths["outside"]
    anywhere = LoRAPathPolicy.from_args(EngineArgs(model="m", allow_any_lora_path=True))
    assert anywhere.resolve(paths["outside"]) == os.path.realpath(paths["outside"])
    with pytest.raises(LoRAFileError, match="not a regular file"):
        anywhere.resolve(paths["weights a device"])


def test_refused_paths_all_say_the_same_and_the_engine_serves_on(tiny_model_dir, tmp_path, tiny_loras):
    """Through the engine (what /v1/load_lora_adapter runs on each replica): every refused
    path is LoRANotLoadable with the same words, naming no path; nothing stays loaded or
    prepared; an adapter inside the root loads; the engine serves on, no KV block leaked."""
    root, paths = refused_paths(tmp_path, tiny_loras)
    engine = make_engine(tiny_model_dir, [root])
    try:
        want_base = asyncio.run(collect(engine, "base"))

        async def main():
            messages = {}
            for what, path in paths.items():
                with pytest.raises(LoRANotLoadable) as e:
                    await engine.add_lora("x", path)
                messages[what] = str(e.value)
                # the same through a request that names the adapter with a path (a lazy load)
                with pytest.raises(LoRANotLoadable):
                    await collect(engine, f"lazy-{len(messages)}", "x", path)
            assert len(set(messages.values())) == 1, messages
            assert str(tmp_path) not in messages["missing"] and "/" not in messages["missing"]
            assert not engine.lora_keys and not runner_of(engine).lora_adapters and not prepared_of(engine)
            await engine.add_lora("ok", str(root / "ok"))
            assert len(await collect(engine, "ok", "ok")) == SHORT.max_tokens

        asyncio.run(main())
        assert_serves_and_no_leak(engine, want_base)
    finally:
        engine.shutdown()


def test_an_unload_wins_over_a_load_under_way(tiny_model_dir, tiny_loras, monkeypatch):
    """A request naming an adapter this replica lacks loads it first (lazily, with the path
    the ingress sent). Unloaded while that load is under way: the request fails cleanly, the
    weights are never installed, and a request built before the unload (it still carries the
    path) cannot load it back. A request already running with an adapter when it is unloaded
    finishes with it. Only an explicit load serves the name again."""
    held = HeldLoader(monkeypatch)
    path = str(tiny_loras["a"])
    engine = make_engine(tiny_model_dir, [tiny_loras["a"].parent])
    try:
        want_base = asyncio.run(collect(engine, "base"))

        async def main():
            lazy = asyncio.ensure_future(collect(engine, "lazy", "a", path))
            await wait_until(held.entered.is_set, what="the lazy load to start")
            assert await engine.remove_lora("a")  # under way: reported as removed
            held.release.set()
            with pytest.raises(LoRANotLoadable):
                await asyncio.wait_for(lazy, 30)
            await wait_until(lambda: not prepared_of(engine) and not held.held, what="the load to end")
            assert not engine.lora_keys and not runner_of(engine).lora_adapters
            with pytest.raises(LoRANotLoadable):  # built before the unload: no reload
                await collect(engine, "late", "a", path)
            assert not runner_of(engine).lora_adapters
            # An explicit load serves it again; unloaded while a request runs with it, that
            # request finishes with its weights, and the next one is refused.
            await engine.add_lora("a", path)
            want_a = await collect(engine, "a1", "a", sp=LONG)
            stream = engine.generate("Hello, world! How are you", LONG, "a2", lora_name="a", lora_path=path)
            tokens = list((await stream.__anext__()).outputs[0].token_ids)
            assert await engine.remove_lora("a")
            with pytest.raises(LoRANotLoadable):
                await collect(engine, "a3", "a", path)
            async for out in stream:
                tokens += out.outputs[0].token_ids
            assert tokens == want_a

        asyncio.run(main())
        assert held.reads == 2
        assert not runner_of(engine).lora_adapters  # detached once the running request ended
        assert_serves_and_no_leak(engine, want_base)
    finally:
        held.release.set()
        engine.shutdown()
