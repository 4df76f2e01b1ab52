"""How a transfer fails: both end in a failed load (recompute or error, by policy), never in
wrong KV."""

from __future__ import annotations


class KVFormatError(ValueError):
    """A payload that is not what it claims to be (truncated, corrupt, foreign)."""


class TransferError(RuntimeError):
    """A fetch or export failed (missing, late, refused)."""
