"""The Responses store is bounded by count and by bytes: a chain of `previous_response_id`
turns stores its whole conversation again at every turn, so the count alone let memory
grow with the square of a conversation's length."""

import json

import pytest

from fleetserve.router.api.errors import APIError
from fleetserve.router.api.responses import ResponseStore


def _entry(i: int, text: str) -> tuple[dict, list[dict]]:
    return {"id": f"resp_{i}", "output": text}, [{"role": "user", "content": text}]


def _size(response: dict, conversation: list[dict]) -> int:
    return len(json.dumps(response)) + len(json.dumps(conversation))


def test_bytes_bound_evicts_oldest_first():
    one = _size(*_entry(0, "x" * 1000))
    store = ResponseStore(capacity=100, max_bytes=3 * one)
    for i in range(10):
        assert store.put(*_entry(i, "x" * 1000))
        assert store.nbytes <= store.max_bytes
    assert len(store) == 3
    assert store.nbytes == 3 * one
    for i in range(7):
        with pytest.raises(APIError) as e:
            store.get(f"resp_{i}")
        assert e.value.status == 404
    assert [store.get(f"resp_{i}")[0]["id"] for i in (7, 8, 9)] == ["resp_7", "resp_8", "resp_9"]


def test_growing_chain_stays_within_bytes():
    """Each turn's conversation holds every earlier turn: the store keeps the newest
    turns that fit, never more than its byte bound."""
    store = ResponseStore(capacity=1024, max_bytes=200_000)
    conversation: list[dict] = []
    for i in range(300):
        conversation = conversation + [{"role": "user", "content": "turn %d " % i + "y" * 200}]
        store.put({"id": f"resp_{i}"}, conversation)
        assert store.nbytes <= 200_000
    assert store.get("resp_299")[1] == conversation  # the newest is there
    assert len(store) < 300


def test_entry_over_the_bound_alone_is_not_stored():
    store = ResponseStore(capacity=10, max_bytes=1000)
    assert store.put(*_entry(0, "small"))
    assert not store.put(*_entry(1, "z" * 5000))
    assert len(store) == 1 and store.get("resp_0")
    with pytest.raises(APIError):
        store.get("resp_1")


def test_count_bound_and_delete_keep_bytes_exact():
    store = ResponseStore(capacity=2, max_bytes=1 << 20)
    for i in range(5):
        store.put(*_entry(i, "a" * i))
    assert len(store) == 2
    assert store.nbytes == _size(*_entry(3, "aaa")) + _size(*_entry(4, "aaaa"))
    store.delete("resp_3")
    assert store.nbytes == _size(*_entry(4, "aaaa"))
    store.put(*_entry(4, "b"))  # the same id again replaces it
    assert len(store) == 1 and store.nbytes == _size(*_entry(4, "b"))
