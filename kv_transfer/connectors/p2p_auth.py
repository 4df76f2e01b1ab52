"""Authenticated use of a producer's TCPStore (the P2P rendezvous): with the cluster's KV
secret, every value the protocol reads from the store is sealed by someone who holds it.

torch's TCPStore lets any client that reaches its port read, list, write and delete any key,
and has no hook for a handshake. So the protocol authenticates values, not connections:

* The producer's server, at start, draws a random 16-byte salt and publishes
  "auth/salt" = salt + HMAC(secret, "p2p-salt", salt). A consumer's new store client reads
  it and checks the proof before anything else: a producer with another secret, or none,
  fails the pull at once with a clear error (and so does a secret-less consumer of a keyed
  producer), not at the load's deadline.
* Every value written under a protocol key (the pull requests in the "pulls" queue, the
  headers, the verdicts, and the gloo/NCCL rendezvous values, through AuthStore) carries a
  32-byte HMAC-SHA256 tag under that store's key (derived from the secret and the salt) over
  the key's name and the value. A value without a valid tag is refused: an unauthenticated
  client cannot ask for an export, answer a pull, or put its own address into a group's
  rendezvous (so KV is neither read out by nor accepted from it); a valid value cannot be
  moved to another key (the name is under the tag) or to another producer (another salt).
  The server also drops a pull id it has served before (a replayed request).

What it does not do: encrypt (an observer of the network sees the KV bytes and the keys'
names), authenticate the counters (`add`) or stop a client from deleting keys or filling
the store (denial of service, not theft or injection). Without a secret, values go as they
are (the unauthenticated protocol, one warning per process).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
from typing import TYPE_CHECKING, Optional, Union

from fleetserve.kv_transfer.errors import TransferError
from fleetserve.kv_transfer.secret import KV_SECRET_ENV, ClusterSecret

if TYPE_CHECKING:
    import torch.distributed as dist

SALT_KEY = "auth/salt"
SALT_BYTES = 16
TAG_BYTES = 32


class AuthError(TransferError):
    """A peer or a value that is not authenticated by the cluster's secret."""


class StoreAuth:
    """One producer store's sealing key (derived from the secret and the store's salt)."""

    __slots__ = ("_key",)

    def __init__(self, secret: ClusterSecret, salt: bytes) -> None:
        self._key = secret.key("p2p-store/" + salt.hex())

    def _tag(self, name: str, value: bytes) -> bytes:
        n = name.encode()
        return hmac.new(self._key, len(n).to_bytes(4, "little") + n + value, hashlib.sha256).digest()

    def seal(self, name: str, value: bytes) -> bytes:
        return value + self._tag(name, value)

    def open(self, name: str, sealed: bytes) -> bytes:
        """The value sealed under `name`, or AuthError (naming the key, not its value)."""
        value, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
        if len(sealed) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(name, value)):
            raise AuthError(f"store value under {name!r} is not sealed with the cluster's KV secret")
        return value

    def __repr__(self) -> str:
        return "StoreAuth(<redacted>)"


def publish_salt(store: dist.Store, secret: Optional[ClusterSecret]) -> Optional[StoreAuth]:
    """The producer's side, once at start: a new salt and its proof (None without a secret)."""
    if secret is None:
        return None
    salt = os.urandom(SALT_BYTES)
    store.set(SALT_KEY, salt + secret.mac("p2p-salt", salt))  # type: ignore[arg-type]  # bytes
    return StoreAuth(secret, salt)


def read_salt(store: dist.Store, secret: Optional[ClusterSecret], addr: str) -> Optional[StoreAuth]:
    """The consumer's side, on each new store client: the producer's sealing key, or
    AuthError when the producer's secret is not this engine's (or only one side has one)."""
    published = store.check([SALT_KEY])
    if secret is None:
        if published:
            raise AuthError(f"producer {addr} requires the cluster's KV secret ({KV_SECRET_ENV}); this engine has none")
        return None
    if not published:
        raise AuthError(
            f"producer {addr} runs without a KV secret; this engine has one and pulls only from peers that do"
        )
    raw = store.get(SALT_KEY)
    salt, proof = raw[:SALT_BYTES], raw[SALT_BYTES:]
    if len(salt) != SALT_BYTES or not hmac.compare_digest(proof, secret.mac("p2p-salt", salt)):
        raise AuthError(f"producer {addr} holds another KV secret than this engine")
    return StoreAuth(secret, salt)


class Channel:
    """A store client and its producer's sealing key (None: values go as they are)."""

    __slots__ = ("store", "auth")

    def __init__(self, store: dist.TCPStore, auth: Optional[StoreAuth]) -> None:
        self.store, self.auth = store, auth

    def put(self, name: str, value: bytes) -> None:
        self.store.set(name, self.auth.seal(name, value) if self.auth else value)  # type: ignore[arg-type]

    def take(self, name: str) -> bytes:
        """The value under `name` (waits for it up to the client's timeout), checked."""
        raw = self.store.get(name)
        return self.auth.open(name, raw) if self.auth else raw

    def push(self, queue: str, value: bytes) -> None:
        self.store.queue_push(queue, self.auth.seal(queue, value) if self.auth else value)

    def pop(self, queue: str) -> bytes:
        """The next item of `queue` (waits up to the client's timeout); AuthError for an item
        not sealed with the secret (it is gone from the queue either way)."""
        raw = self.store.queue_pop(queue, block=True)
        return self.auth.open(queue, raw) if self.auth else raw

    def group_store(self, prefix: str) -> dist.Store:
        """The store a two-rank group's rendezvous runs through, under `prefix`."""
        import torch.distributed as dist

        if self.auth is None:
            return dist.PrefixStore(prefix, self.store)
        return _sealed_store(self.store, self.auth, prefix)


def _sealed_store(inner: dist.Store, auth: StoreAuth, prefix: str) -> dist.Store:
    """A dist.Store (gloo's and NCCL's rendezvous call it from C++) that seals every value it
    sets and refuses every value it gets that is not sealed, under `prefix`."""
    import torch.distributed as dist

    class SealedStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()

        def _name(self, key: str) -> str:
            return f"{prefix}/{key}"

        def set(self, key: str, value: Union[str, bytes]) -> None:
            raw = value.encode() if isinstance(value, str) else bytes(value)
            inner.set(self._name(key), auth.seal(self._name(key), raw))  # type: ignore[arg-type]

        def get(self, key: str) -> bytes:
            return auth.open(self._name(key), inner.get(self._name(key)))

        def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
            names = [self._name(k) for k in keys]
            inner.wait(names) if timeout is None else inner.wait(names, timeout)

        def check(self, keys: list[str]) -> bool:
            return inner.check([self._name(k) for k in keys])

        def add(self, key: str, amount: int) -> int:
            return inner.add(self._name(key), amount)

        def delete_key(self, key: str) -> bool:
            return inner.delete_key(self._name(key))

        def num_keys(self) -> int:
            return inner.num_keys()

    return SealedStore()
