"""The engine core's messages and client interface: every kind has one message class, a
frame carries it whole and unchanged, a frame that lies about its kind (or is not a message)
is refused, and both client layouts implement the whole interface."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from fleetserve.replica.engine import core_messages as msg
from fleetserve.replica.engine.core_client import EngineCoreClient
from fleetserve.replica.engine.process_client import ProcessCoreClient
from fleetserve.replica.engine.step_result import StepResult
from fleetserve.replica.engine.thread_client import ThreadCoreClient
from fleetserve.scheduler import Request, SamplingParams, SchedulerStats


def _state() -> msg.CoreState:
    load = msg.EngineLoad(
        num_running=1, num_waiting=2, num_queued_tokens=30, kv_cache_usage=0.5, num_free_blocks=8, num_blocks=16
    )
    stats = SchedulerStats(
        num_running=1,
        num_waiting=2,
        num_waiting_for_remote_kvs=0,
        kv_cache_usage=0.5,
        num_free_blocks=8,
        num_blocks=16,
        prefix_cache_queries=3,
        prefix_cache_hits=1,
        num_preemptions=0,
    )
    return msg.CoreState(load, stats, adds_seen=4)


SAMPLES = [
    msg.Init({"model": "m"}, 2, "/dev/shm/x"),
    msg.Add([Request("r", [1, 2, 3], SamplingParams(max_tokens=4))]),
    msg.Abort(["a", "b"]),
    msg.Finish(["c"]),
    msg.AddLoRA(1, 7, "sql", "/loras/sql"),
    msg.RemoveLoRA(2, 7),
    msg.Ping(3),
    msg.Shutdown(),
    msg.Ready(msg.CoreInfo(2048, 32000, 64), _state(), progress=True),
    msg.InitFailed("ValueError: no"),
    msg.Step(StepResult([], ["r"], 3, 1.5), _state()),
    msg.State(_state()),
    msg.Failed("RuntimeError: boom", dead=False),
    msg.Pong(3),
    msg.LoRADone(1, None),
]


def test_every_kind_has_one_message_class_and_a_sample_here():
    assert sorted(type(m).KIND for m in SAMPLES) == sorted(msg.Kind)
    for m in SAMPLES:
        assert dataclasses.is_dataclass(m) and type(m).__dataclass_params__.frozen


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).KIND.name)
def test_a_message_crosses_a_frame_unchanged(message):
    back = msg.decode(msg.encode(message))
    assert type(back) is type(message)
    if isinstance(message, msg.Add):  # Request has no value equality: compare what it carries
        assert [(r.request_id, r.prompt_token_ids) for r in back.requests] == [("r", [1, 2, 3])]
    else:
        assert back == message


def test_a_frame_that_lies_about_its_kind_or_is_no_message_is_refused():
    with pytest.raises(msg.ProtocolError, match="ADD frame holds a Shutdown"):
        msg.decode(pickle.dumps((int(msg.Kind.ADD), msg.Shutdown())))
    with pytest.raises(msg.ProtocolError):
        msg.decode(pickle.dumps((999, msg.Shutdown())))
    with pytest.raises(msg.ProtocolError):
        msg.decode(pickle.dumps(("add", [])))  # the old string-tagged tuples
    with pytest.raises(msg.ProtocolError):
        msg.decode(b"\x00garbage")


def test_both_layouts_implement_the_whole_interface():
    assert inspect.isabstract(EngineCoreClient)
    with pytest.raises(TypeError):
        EngineCoreClient()  # type: ignore[abstract]
    for cls in (ThreadCoreClient, ProcessCoreClient):
        assert issubclass(cls, EngineCoreClient) and not inspect.isabstract(cls), cls.__abstractmethods__
