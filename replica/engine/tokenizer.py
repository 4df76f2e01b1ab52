"""Tokenizers for HF folders and GGUF files, and chat formatting.

A GGUF file carries its tokenizer as metadata (`tokenizer.ggml.*`);
transformers converts it to a fast tokenizer, which takes seconds for SmolLM2's
49k vocabulary (figures: docs/deployment/cpu.md, "Figures behind the code"). The result is saved once under
`$FLEETSERVE_CACHE_DIR/tokenizers/<key>/` (default `~/.cache/fleetserve`),
keyed by the file's path, size and modification time, so later loads read a
`tokenizer.json` in well under a second. Replicas that start together may
both convert; each writes a private folder and renames it into place, and the
loser's rename simply fails.

`AutoTokenizer` imports transformers' model-configuration machinery and, with it, torch
(seconds of CPU). The replica process holds the tokenizer but never runs the model, so a
folder whose tokenizer AutoTokenizer would load as the plain fast tokenizer anyway (our
GGUF cache; a Llama folder that names `TokenizersBackend`) is loaded through that class
directly (`_plain_fast_folder`; tests/replica/test_tokenizer.py checks the two agree).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from fleetserve.replica.engine.chat_template import check_continue_final_message, check_template_kwargs
from fleetserve.replica.model_loader.registry import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # fast (tokenizers) or SentencePiece backed

logger = logging.getLogger(__name__)

CACHE_ENV = "FLEETSERVE_CACHE_DIR"
_ROLES = {"system", "user", "assistant", "tool", "developer"}


def tokenizer_cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "fleetserve"


def load_tokenizer(source: ModelSource, cache_root: Optional[Path] = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model (the fast one wherever it exists), with its chat template when it has one."""
    if source.kind == "hf":
        return _from_folder(source.path)
    if source.kind != "gguf":
        raise ValueError(f"unknown model source kind {source.kind!r}")
    cached = _cache_dir(source.path, cache_root)
    if (cached / "tokenizer.json").is_file():
        try:
            return _from_folder(cached)
        except Exception as e:  # a damaged cache entry (any parse error): convert again
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = _convert_gguf(source.path)
    _store(tokenizer, cached)
    return tokenizer


# tokenizer_config.json classes that AutoTokenizer loads as they are: the plain fast tokenizer.
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _plain_fast_folder(folder: Path) -> bool:
    """Whether AutoTokenizer would load `folder` as the plain fast tokenizer: its
    tokenizer_config.json names that class, with no custom code, and the folder is our GGUF
    cache (no config.json) or a Llama (transformers maps no tokenizer class of its own to
    `llama`; for some model types it overrides what the folder names, so other folders go
    through AutoTokenizer)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if not (folder / "tokenizer.json").is_file():
            return False
        model_type = (
            json.loads((folder / "config.json").read_text()).get("model_type")
            if (folder / "config.json").exists()
            else None
        )
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict)
        and config.get("tokenizer_class") in _PLAIN_CLASSES
        and "auto_map" not in config
        and model_type in (None, "llama")
    )


def _from_folder(folder: Path) -> PreTrainedTokenizerBase:
    if _plain_fast_folder(folder):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _cache_dir(gguf_path: Path, cache_root: Optional[Path]) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    return (cache_root or tokenizer_cache_root()) / "tokenizers" / key


def _convert_gguf(gguf_path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    logger.info("converting the tokenizer of %s (once; cached afterwards)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        template = _gguf_chat_template(gguf_path)
        if template:
            tokenizer.chat_template = template
    return tokenizer


def _gguf_chat_template(gguf_path: Path) -> Optional[str]:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _store(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    except OSError as e:
        logger.warning("cannot cache the tokenizer under %s: %s", target.parent, e)
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, target)
    except OSError:
        # Another process stored it first (or the disk refused): either way
        # the tokenizer in hand is good.
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text for a conversation, checked first so that bad input is a ValueError.
    `chat_template_kwargs`: extra template variables (vLLM's, e.g. `enable_thinking`);
    `continue_final_message` (vLLM's): the last message is left open, for the model to go on
    with (a prefilled assistant reply)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model has no chat template; send a plain prompt instead, or start the engine with --chat-template"
        )
    normalized = [_check_message(i, m) for i, m in enumerate(_check_list(messages))]
    extra = check_template_kwargs(chat_template_kwargs)
    check_continue_final_message(add_generation_prompt, continue_final_message)
    if continue_final_message:
        extra["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(
            normalized, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as e:  # jinja2 errors (e.g. `raise_exception` in a template) are the user's input
        if type(e).__module__.startswith("jinja2"):
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        if continue_final_message and isinstance(e, ValueError):  # transformers: no final message to continue
            raise ValueError(f"continue_final_message: {e}") from e
        raise
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def _check_list(messages: Any) -> list:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    return list(messages)


def _check_message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        content = "".join(_text_part(i, j, part) for j, part in enumerate(content))
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {content!r}")
    return {**message, "content": content}


def _text_part(i: int, j: int, part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
