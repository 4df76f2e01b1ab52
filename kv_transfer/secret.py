"""The cluster's KV secret: what authenticates P2P peers and keys shared-storage digests.

Read in each engine process from one place, the environment:

    FLEETSERVE_KV_SECRET        the secret itself (at least 16 bytes), or
    FLEETSERVE_KV_SECRET_FILE   a file holding it (surrounding whitespace stripped)

Never from a config, a flag or an actor argument, so it is not in `ps`, in a config's repr,
in Ray's runtime_env or in a log. The bytes only ever live in a ClusterSecret, whose repr
says nothing, which refuses to be pickled, and whose keys are derived per use (HMAC-SHA256
of a label), so no two uses share a key. No secret configured: everything works as before,
unauthenticated, and the first use in a process logs one warning (`warn_unkeyed`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import Mapping, NoReturn, Optional

logger = logging.getLogger(__name__)

KV_SECRET_ENV = "FLEETSERVE_KV_SECRET"
KV_SECRET_FILE_ENV = "FLEETSERVE_KV_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096

_warned: set[str] = set()
_warned_lock = threading.Lock()


class ClusterSecret:
    """The secret's bytes, hidden: derive keys with `key(label)`, MAC with `mac(label, ...)`."""

    __slots__ = ("_root",)

    def __init__(self, raw: bytes) -> None:
        if not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
            raise ValueError(
                f"the KV secret ({KV_SECRET_ENV} or {KV_SECRET_FILE_ENV}) must be "
                f"{MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes long"
            )
        self._root = hashlib.sha256(b"fleetserve-kv-secret\0" + raw).digest()

    def key(self, label: str) -> bytes:
        """A 32-byte key for one use (`label` names it: "p2p-store/<salt>", "storage-digest")."""
        return hmac.new(self._root, label.encode(), hashlib.sha256).digest()

    def mac(self, label: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 under key(label) of `parts`, each length-prefixed (no two lists of
        parts give the same input)."""
        h = hmac.new(self.key(label), digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "little"))
            h.update(p)
        return h.digest()

    def __repr__(self) -> str:
        return "ClusterSecret(<redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"a ClusterSecret is never pickled: each process reads {KV_SECRET_ENV} itself")


def load_secret(environ: Optional[Mapping[str, str]] = None) -> Optional[ClusterSecret]:
    """The configured secret, or None when neither variable is set; ValueError (naming the
    variable, never the value) when both are set, the file cannot be read, or the length
    is out of bounds."""
    env = os.environ if environ is None else environ
    raw, path = env.get(KV_SECRET_ENV), env.get(KV_SECRET_FILE_ENV)
    if raw and path:
        raise ValueError(f"set one of {KV_SECRET_ENV} and {KV_SECRET_FILE_ENV}, not both")
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_SECRET_BYTES + 1)
        except OSError as e:
            raise ValueError(f"cannot read the KV secret file named by {KV_SECRET_FILE_ENV}: {e.strerror}") from None
        return ClusterSecret(data.strip())
    return ClusterSecret(raw.encode()) if raw else None


def warn_unkeyed(what: str, risk: str) -> None:
    """Log, once per process and `what`, that `what` runs without a secret and what that risks."""
    with _warned_lock:
        if what in _warned:
            return
        _warned.add(what)
    logger.warning(
        "%s runs without a KV secret (%s or %s unset): %s. See docs/serving/kv-transfer.md#security.",
        what,
        KV_SECRET_ENV,
        KV_SECRET_FILE_ENV,
        risk,
    )
