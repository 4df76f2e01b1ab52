"""The torch.distributed plumbing both sides of a P2P pull share: connecting to a producer's
store within a deadline, two-rank groups (kept ones in an LRU), message tags, and the pull
request a consumer pushes onto the producer's queue (sealed: p2p_auth)."""

from __future__ import annotations

import collections
import datetime
import socket
import threading
import time
from typing import TYPE_CHECKING, Generic, Optional, Protocol, TypedDict, TypeVar, Union

import torch

from fleetserve.kv_transfer.errors import TransferError

if TYPE_CHECKING:
    import torch.distributed as dist

    from fleetserve.kv_transfer.connectors.p2p_auth import Channel

STORE_TIMEOUT_S = 30.0
# A live producer's store accepts at once (3 s was overrun once on a loaded 2-core host);
# a dead one's port refuses.
CONNECT_TIMEOUT_S = 6.0
PULLS = "pulls"  # the queue of pull requests a producer's server threads take from
PULL_IDS = "pull_ids"  # the counter a consumer takes a pull's id from (names its keys)
REGROUP = b"!regroup"  # the producer's answer to a pull naming a group it does not have
NOT_YET = b"!notyet"  # ... to a pull of a transfer it has not exported yet (ask again)


class PullRequest(TypedDict):
    """What a consumer asks a producer's server for (JSON, pushed onto PULLS)."""

    pid: int  # this pull's id: its keys are "hdr/<pid>", "go/<pid>"
    oid: str  # "<transfer id>/r<producer rank>"
    backend: str  # "gloo" or "nccl"
    group: Optional[str]  # a kept gloo group's id (None: a group for this pull only, NCCL)
    new: bool  # the consumer forms that group now
    stream: bool  # send chunk by chunk as the blocks are gathered
    readers: int  # consumer ranks that read this shard (the export goes after all of them)


class Group(Protocol):
    """A two-rank process group (gloo or NCCL): what a pull sends and receives over."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> dist.Work: ...


def server_name(engine_id: str, rank: int) -> str:
    """The name a producer rank's server registers under in the owner actor's directory."""
    return f"p2p/{engine_id}/r{rank}"


def nccl_usable(device: torch.device) -> bool:
    import torch.distributed as dist

    return device.type == "cuda" and dist.is_available() and dist.is_nccl_available()


def tag(pid: int) -> int:
    """Tag of pull `pid`'s payload on a kept group."""
    return pid % (1 << 30)


def stream_tag(pid: int, m: int) -> int:
    """Tag of message `m` of streamed pull `pid` (never a `tag`: those stay below 2**30)."""
    return (1 << 30) | ((pid % (1 << 20)) << 10) | m


def timeout_until(deadline: float, least: float = 0.001) -> datetime.timedelta:
    """The time left until `deadline` (a `time.time()`), at least `least` seconds."""
    return datetime.timedelta(seconds=max(least, deadline - time.time()))


_CONNECTING: dict[str, threading.Thread] = {}  # connects given up on, still running (see connect_store)
_CONNECTING_LOCK = threading.Lock()


def connect_store(host: str, port: int, timeout: float, deadline: float) -> dist.TCPStore:
    """A client of a producer's TCPStore within `timeout` seconds, or TransferError; its
    waits for answers then last until `deadline` (a `time.time()`).

    TCPStore's client alone overruns its timeout: it retries a refused port until the
    timeout and then retries the whole connect with backoff (when a killed producer's socket
    accepted a connection and then reset it: docs/design/kv-connector.md). So one plain
    connect first (a dead producer's refusal fails the load at once), then the store is made
    on a thread that is waited for `timeout` at most. A thread given up on ends when torch's
    client does (a reset socket ends it; a producer that accepts and never answers, stopped
    but not dead, can hold it for minutes), so there is at most one per address: while it
    lives, pulls from that address fail at once.
    """
    import torch.distributed as dist

    addr = f"{host}:{port}"
    with _CONNECTING_LOCK:
        stuck = _CONNECTING.get(addr)
        if stuck is not None and stuck.is_alive():
            raise TransferError(f"point-to-point server {addr} did not answer an earlier connect; still waiting on it")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:  # refused, unreachable, timed out
        raise TransferError(
            f"point-to-point server {host}:{port} unreachable ({e}); stopped, or not reachable from here"
        ) from None
    box: list[Union[dist.TCPStore, Exception]] = []
    done = threading.Event()

    def make() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
            store.set_timeout(timeout_until(deadline, 0.5))
            box.append(store)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=make, name="p2p-connect", daemon=True)
    thread.start()
    if not done.wait(timeout):
        with _CONNECTING_LOCK:
            for gone in [a for a, t in _CONNECTING.items() if not t.is_alive()]:
                del _CONNECTING[gone]
            _CONNECTING[addr] = thread
        raise TransferError(f"point-to-point server {host}:{port} did not answer within {timeout:.1f} s")
    got = box[0]
    if isinstance(got, Exception):
        raise TransferError(f"point-to-point server {host}:{port}: {got}") from None
    return got


V = TypeVar("V")


class Groups(Generic[V]):
    """Kept gloo groups, least recently used first out (each holds a TCP connection and
    gloo's threads)."""

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self._groups: collections.OrderedDict[str, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[V]:
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                self._groups.move_to_end(key)
            return group

    def put(self, key: str, group: V) -> None:
        with self._lock:
            self._groups[key] = group
            self._groups.move_to_end(key)
            while len(self._groups) > self.cap:
                self._groups.popitem(last=False)

    def drop(self, key: str, group: Optional[V] = None) -> None:
        with self._lock:
            if group is None or self._groups.get(key) is group:
                self._groups.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def clear(self) -> None:
        with self._lock:
            self._groups.clear()


def make_group(chan: Channel, name: Union[str, int], rank: int, timeout_s: float, backend: str) -> Group:
    """The two-rank group `name` (a pull id, or a kept group's id; rank 0: the producer),
    its rendezvous through `chan` (sealed with the cluster's secret when it has one)."""
    import torch.distributed as dist

    prefixed = chan.group_store(f"pg/{name}")
    timeout = datetime.timedelta(seconds=max(0.5, timeout_s))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # (torch's stubs give these backends no send/recv; the bindings have them)
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)  # type: ignore[return-value]
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)  # type: ignore[return-value]
