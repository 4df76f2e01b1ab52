"""`kv_transfer_params`: the per-request dict that says "export my KV" or "load it from there".

Only plain JSON values are accepted (nothing is ever unpickled from a caller), and
a transfer is named by the caller's `transfer_id`, never by an engine-internal
request id (vLLM's P2P connector hung once engines randomised their ids).
"""

from __future__ import annotations

import re
from typing import Any, Optional

_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_SCALARS = (str, int, float, bool, type(None))


def validate_kv_transfer_params(params: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Check the shape of `params`; returns a plain copy, or raises ValueError saying why."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    out: dict[str, Any] = {}
    for key, value in params.items():
        if not isinstance(key, str) or not (key.startswith("remote_") or key in _KNOWN):
            raise ValueError(f"kv_transfer_params: unknown key {key!r}")
        if not isinstance(value, _SCALARS):
            raise ValueError(f"kv_transfer_params.{key} must be a string, number, bool or null")
        out[key] = value
    decode, prefill = bool(out.get("do_remote_decode")), bool(out.get("do_remote_prefill"))
    if decode and prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
    if decode or prefill:
        tid = out.get("transfer_id")
        if not isinstance(tid, str) or not _ID.match(tid):
            raise ValueError("kv_transfer_params.transfer_id must be 1-128 characters of [A-Za-z0-9_.:-]")
    if prefill:
        n = out.get("remote_num_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError("kv_transfer_params.remote_num_tokens must be a non-negative integer")
    return out


_KNOWN = {"do_remote_decode", "do_remote_prefill", "transfer_id"}
