"""Upper bounds on everything a client sends, checked at the ingress before any work.

A request's cost must be bounded before it is tokenized, pickled to an engine or
checked against every step's text: one completion with 100,000 stop strings, or
n=1000, once produced a command larger than the engine-core pipe could take in one
go (issue 15), and stop strings are matched against every new piece of text. Each
bound is generous for real use and far below what hurts:

| what | bound | why this value |
|---|---|---|
| `n` | 128 | OpenAI's own limit |
| prompts in one `/v1/completions` body | 256 | each is a request of its own; at most `FANOUT` in flight |
| inputs of one `/v1/embeddings` body | 2048 | OpenAI's limit (`embeddings.MAX_INPUTS`) |
| stop strings | 32, each <= 256 characters | vLLM has none; OpenAI allows 4 |
| `stop_token_ids` | 256 ids | |
| `bad_words` | 32, each <= 256 characters | as stop strings: checked at every step |
| `logit_bias` | 300 entries, values in [-100, 100] | OpenAI's own limits (`MAX_LOGIT_BIAS`) |
| `allowed_token_ids` | 131072 ids as sent, duplicates dropped | vLLM: the vocabulary only (`MAX_ALLOWED_TOKEN_IDS`) |
| chat messages | 4096 | |
| JSON nesting | 64 levels | a chat body nests ~5; Python's parser recurses |
| float fields | finite | NaN passes every `< 0` check; inf is no temperature |
| `seed` | 64-bit | what torch.Generator takes |

Prompt length is bounded by characters before tokenizing: a token of this
vocabulary covers at most `max_token_chars` characters, so a prompt of more than
`max_model_len * max_token_chars` characters cannot fit the context, whatever it
says, and is refused without tokenizing megabytes (`check_prompt_chars`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from fleetserve.replica.engine.processor import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS
from fleetserve.router.api.errors import APIError

MAX_N = 128
MAX_PROMPTS = 256
# Engine requests one client request keeps in flight at once (a prompt list's prompts, an
# embeddings body's inputs); the rest wait their turn in the ingress, not in Serve's queues.
FANOUT = 16
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
MAX_JSON_DEPTH = 64
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# JSON escapes of UTF-16 surrogates (\ud800-\udfff); a valid pair is fine, a lone one is not.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_sampling(params, prefix: str = "") -> None:
    """Bounds on a validated `SamplingParams`; APIError(400) naming the field otherwise."""

    def bad(name: str, message: str) -> APIError:
        return APIError(f"{prefix}{name} {message}", 400, param=f"{prefix}{name}")

    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not math.isfinite(value):
            raise bad(name, f"must be a finite number, got {value!r}")
    if params.n > MAX_N:
        raise bad("n", f"must be at most {MAX_N}, got {params.n}")
    if params.best_of is not None and params.best_of > MAX_N:
        raise bad("best_of", f"must be at most {MAX_N}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters long")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}")
    if any(t >= 1 << 31 for t in params.stop_token_ids):
        raise bad("stop_token_ids", "must be token ids")
    if len(params.bad_words or ()) > MAX_STOP_STRINGS:
        raise bad("bad_words", f"may hold at most {MAX_STOP_STRINGS} words, got {len(params.bad_words)}")
    if any(len(w) > MAX_STOP_STRING_CHARS for w in params.bad_words or ()):
        raise bad("bad_words", f"must be at most {MAX_STOP_STRING_CHARS} characters long each")
    check_token_lists(params.logit_bias, params.allowed_token_ids, prefix)
    if any(t >= 1 << 31 for t in params.allowed_token_ids or ()):
        raise bad("allowed_token_ids", "must be token ids")
    if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
        raise bad("seed", "must fit in 64 bits")
    if params.top_k >= 1 << 31:
        raise bad("top_k", "is too large")


def check_token_lists(logit_bias: Any, allowed_token_ids: Any, prefix: str = "") -> Optional[list]:
    """Bound `logit_bias` and `allowed_token_ids` by their sizes as sent, before anything
    walks them (APIError(400) naming the field); returns allowed_token_ids deduplicated
    (first occurrence kept), or it unchanged when it is not a list (SamplingParams names
    what is wrong with it)."""
    if isinstance(logit_bias, dict) and len(logit_bias) > MAX_LOGIT_BIAS:
        raise APIError(
            f"{prefix}logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(logit_bias)}",
            400,
            param=f"{prefix}logit_bias",
        )
    if not isinstance(allowed_token_ids, list):
        return allowed_token_ids
    if len(allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise APIError(
            f"{prefix}allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed_token_ids)}",
            400,
            param=f"{prefix}allowed_token_ids",
        )
    try:
        return list(dict.fromkeys(allowed_token_ids))
    except TypeError:  # unhashable entries: SamplingParams refuses them, naming the field
        return allowed_token_ids


def max_token_chars(tokenizer) -> int:
    """The most characters any one token of `tokenizer` decodes to (at least 1)."""
    longest = 1
    for piece in tokenizer.get_vocab():
        longest = max(longest, len(piece))
    # Byte-level BPE pieces spell a byte as one symbol, so a piece never decodes to more
    # characters than it has symbols; a few special spellings (e.g. "<0x0A>") decode to
    # fewer. Added tokens are in the vocabulary too.
    return longest


def check_prompt_chars(text: str, max_model_len: int, token_chars: int, param: str) -> None:
    """Refuse a prompt that cannot fit the context, by its length in characters alone."""
    limit = max_model_len * token_chars
    if len(text) > limit:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens; your "
            f"{param} has {len(text)} characters, more than {max_model_len} tokens "
            "can hold; shorten it.",
            400,
            param=param,
            code="context_length_exceeded",
        )


def check_json_shape(raw: bytes, data: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH and strings with lone UTF-16 surrogates
    (they cannot be encoded as UTF-8: tokenizers and responses fail on them). The walk only
    runs when the raw body could hold either (cheap byte checks first)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH and not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_utf8(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", 400)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(key, str):
                _check_utf8(key, path)
            stack.append((child, depth + 1, f"{path}.{key}" if path else str(key)))


def _check_utf8(value: str, path: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            f"{path or 'the body'} contains a lone UTF-16 surrogate (not valid Unicode text)",
            400,
            param=_safe_param(path),
        ) from None


def _safe_param(path: str) -> Optional[str]:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return path or None


# Fields only fleetserve itself sets (the P/D router mints kv_transfer_params; request
# routing reads underscore keys): a client that sends one is refused, not ignored.
INTERNAL_FIELDS = ("kv_transfer_params",)


def check_prompt_count(count: int, param: str = "prompt") -> None:
    if count > MAX_PROMPTS:
        raise APIError(f"{param} may hold at most {MAX_PROMPTS} prompts, got {count}", 400, param=param)


def check_internal_fields(data: dict) -> None:
    for key in data:
        if key in INTERNAL_FIELDS or (isinstance(key, str) and key.startswith("_")):
            raise APIError(f"{key} is an internal field and cannot be set by a client", 400, param=_safe_param(key))


def parse_json(raw: bytes) -> Any:
    """json.loads with the shape checks above; APIError(400) for anything malformed."""
    import json

    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", 400) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400) from e
    check_json_shape(raw, data)
    return data
