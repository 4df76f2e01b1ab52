"""Tokenizer loading (HF folder, GGUF with an on-disk cache) and chat formatting."""

from __future__ import annotations

import time

import pytest

from fleetserve.replica.engine.detokenizer import IncrementalDetokenizer
from fleetserve.replica.engine.tokenizer import apply_chat_template, load_tokenizer
from fleetserve.replica.model_loader.registry import ModelSource
from fleetserve.scheduler.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return load_tokenizer(ModelSource("tiny", "hf", tiny_model_dir))


def test_hf_folder_tokenizer(tiny_tok):
    assert tiny_tok.eos_token_id == 2 and tiny_tok.bos_token_id == 1
    text = "Hello world! héllo 🎉"
    assert tiny_tok.decode(tiny_tok.encode(text)) == text


def test_chat_template_chatml(tiny_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert apply_chat_template(tiny_tok, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert apply_chat_template(tiny_tok, messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_chat_template_text_parts(tiny_tok):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert "user\nHello there<|im_end|>" in apply_chat_template(tiny_tok, [{"role": "user", "content": parts}])


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ("hello", "must be a list"),
        ([], "must not be empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\].role"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\].role"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\].content"),
        ([{"role": "user"}], r"messages\[0\].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ],
)
def test_malformed_messages_are_value_errors(tiny_tok, messages, fragment):
    with pytest.raises(ValueError, match=fragment):
        apply_chat_template(tiny_tok, messages)


def test_template_exceptions_become_value_errors(tiny_model_dir):
    tok = load_tokenizer(ModelSource("tiny", "hf", tiny_model_dir))
    tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    assert apply_chat_template(tok, [{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        apply_chat_template(tok, [{"role": "assistant", "content": "no"}])


_SAMPLES = [
    "Hello world",
    "  leading spaces and\ttabs\n",
    "héllo 你好 🎉 naïve",
    "def f(x):\n    return x",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def assert_same_as_auto(tok, folder) -> None:
    """`tok` is what AutoTokenizer makes of `folder`: same class, ids, special tokens, template."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(folder))
    assert type(tok) is type(auto)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
        len(auto),
    )
    assert tok.chat_template == auto.chat_template
    for text in _SAMPLES:
        assert tok.encode(text) == auto.encode(text)
        assert tok(text, add_special_tokens=True)["input_ids"] == auto(text, add_special_tokens=True)["input_ids"]
        assert tok.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🎉"}]
    assert apply_chat_template(tok, messages) == apply_chat_template(auto, messages)


def test_plain_fast_folders_load_as_autotokenizer_would(tiny_model_dir, tiny_tok):
    from fleetserve.replica.engine.tokenizer import _plain_fast_folder

    assert _plain_fast_folder(tiny_model_dir)  # loaded without AutoTokenizer (see the module)
    assert_same_as_auto(tiny_tok, tiny_model_dir)


def test_other_folders_go_through_autotokenizer(tiny_model_dir, tmp_path):
    import json
    import shutil

    from fleetserve.replica.engine.tokenizer import _plain_fast_folder

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert not _plain_fast_folder(tmp_path)  # transformers may pick another class for qwen2
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    custom = {**tok_config, "auto_map": {"AutoTokenizer": ["x.Y", None]}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(custom))
    assert not _plain_fast_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert not _plain_fast_folder(tmp_path)


def test_replica_side_imports_neither_torch_nor_the_engine(tiny_model_dir):
    """The replica process (AsyncEngine in front of a core process) tokenizes and
    detokenizes but never runs the model: importing torch there cost ~3 s of CPU per start."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fleetserve.replica.engine.async_engine import AsyncEngine\n"
        "from fleetserve.replica.engine.tokenizer import load_tokenizer\n"
        "from pathlib import Path\n"
        "from fleetserve.replica.model_loader.registry import ModelSource\n"
        "from fleetserve.replica.engine.step_result import StepResult\n"
        "import pickle\n"
        f"tok = load_tokenizer(ModelSource('tiny', 'hf', Path({str(tiny_model_dir)!r})))\n"
        "assert tok.encode('hi')\n"
        "pickle.loads(pickle.dumps(StepResult([])))\n"
        "from fleetserve.replica.engine.engine_args import EngineArgs\n"
        "EngineArgs(model='tiny', cpu_bind='0-1|2')\n"
        "import fleetserve.router.replica\n"
        "print(sorted(m for m in ('torch', 'fleetserve.replica.engine.engine_core') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_no_chat_template_is_a_value_error(tiny_model_dir):
    tok = load_tokenizer(ModelSource("tiny", "hf", tiny_model_dir))
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])


# ---- the real SmolLM2 GGUF tokenizer ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_source():
    from fleetserve.replica.model_loader.registry import ModelNotFoundError, resolve_model

    try:
        return resolve_model("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fleetserve-cache")


@pytest.fixture(scope="module")
def smollm_tok(smollm_source, smollm_cache):
    return load_tokenizer(smollm_source, cache_root=smollm_cache)


@pytest.mark.real_model
def test_gguf_tokenizer_is_cached_on_disk(smollm_source, smollm_cache, smollm_tok):
    stored = list((smollm_cache / "tokenizers").glob("*/tokenizer.json"))
    assert len(stored) == 1
    start = time.perf_counter()
    again = load_tokenizer(smollm_source, cache_root=smollm_cache)
    assert time.perf_counter() - start < 5.0  # the conversion takes ~10 s
    text = "Hello, world! héllo 你好 🎉"
    assert again.encode(text) == smollm_tok.encode(text)
    assert again.chat_template == smollm_tok.chat_template
    assert_same_as_auto(again, stored[0].parent)  # the cached folder, loaded without AutoTokenizer


@pytest.mark.real_model
def test_smollm_special_tokens_and_round_trip(smollm_tok):
    assert (smollm_tok.bos_token_id, smollm_tok.eos_token_id, smollm_tok.pad_token_id) == (1, 2, 2)
    assert smollm_tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert len(smollm_tok) == 49152
    for text in ["Hello world", "  leading spaces and\ttabs\n", "héllo 你好 🎉 naïve", "def f(x):\n    return x"]:
        assert smollm_tok.decode(smollm_tok.encode(text)) == text
    assert smollm_tok.encode("Hello world") == [19556, 905]


@pytest.mark.real_model
def test_smollm_chat_template(smollm_tok, smollm_source):
    from gguf import GGUFReader

    embedded = GGUFReader(str(smollm_source.path)).fields["tokenizer.chat_template"].contents()
    assert smollm_tok.chat_template == embedded
    text = apply_chat_template(smollm_tok, [{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm_tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2


@pytest.mark.real_model
def test_smollm_incremental_detokenization(smollm_tok):
    prompt = smollm_tok.encode(apply_chat_template(smollm_tok, [{"role": "user", "content": "hi"}]))
    text = "Bonjour! 你好，世界 🎉🦊 — naïve café. Done."
    ids = smollm_tok.encode(text) + [2]
    detok = IncrementalDetokenizer(smollm_tok, prompt, SamplingParams())
    deltas = [detok.update([i])[0] for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    detok = IncrementalDetokenizer(smollm_tok, prompt, SamplingParams(stop=["世界"]))
    emitted, matched = "", None
    for i in ids:
        delta, matched = detok.update([i])
        emitted += delta
        assert "世" not in emitted
        if matched:
            break
    assert matched == "世界" and emitted == "Bonjour! 你好，"
