"""The messages between an EngineCore and its client, one frozen dataclass per kind.

`Kind` numbers the messages; each message class names its kind (`KIND`). Both layouts
speak them: the in-process client (`thread_client`) queues the command objects for its
engine thread, and the process client (`process_client`) sends them, and reads the
replies, over the core process's pipe (`core_process`), one per frame (`framing`): the
frame's payload is `(kind, message)` pickled, and `decode` refuses a frame whose message
is not of the kind it claims.

Commands, client -> core:

    Init(args, eos_token_id, progress_path)   first, and only to a core process
    Add(requests) | Abort(request_ids) | Finish(request_ids)   (a stop string matched)
    AddLoRA(seq, lora_id, name, path) | RemoveLoRA(seq, lora_id)   answered by LoRADone
    Ping(seq)                                 liveness, answered by Pong between steps
    Shutdown()

Replies, core -> client:

    Ready(info, state, progress) | InitFailed(message)   once, after Init
    Step(result, state)                       per step
    State(state)                              after commands that changed state, no step
    Failed(message, dead)                     a step raised; the core aborted everything in
                                              flight; dead: the executor cannot go on
    Pong(seq) | LoRADone(seq, error)

Only this module, the scheduler's types and `StepResult` are needed to read any of them:
the replica side unpickles replies without importing torch or the engine.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass
from typing import Any, ClassVar, NotRequired, Optional, TypedDict, Union, cast

from fleetserve.replica.engine.step_result import StepResult
from fleetserve.scheduler import Request, SchedulerStats


class Kind(enum.IntEnum):
    # commands
    INIT = 1
    ADD = 2
    ABORT = 3
    FINISH = 4
    ADD_LORA = 5
    REMOVE_LORA = 6
    PING = 7
    SHUTDOWN = 8
    # replies
    READY = 101
    INIT_FAILED = 102
    STEP = 103
    STATE = 104
    FAILED = 105
    PONG = 106
    LORA_DONE = 107


class EngineLoad(TypedDict):
    """What a replica reports to the router's policies (`EngineCore.get_load`)."""

    num_running: int
    num_waiting: int  # waiting, waiting for remote KV, and grammars still compiling
    num_queued_tokens: int  # tokens still to compute: running requests' rest, waiting prompts
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    # time.monotonic() since when no grammar can compile: every compile worker busy past the
    # compile deadline (0.0: not so; StructuredOutputManager.stalled_since). Health reads it.
    grammar_stalled_since: NotRequired[float]
    # Cumulative: steps that computed tokens, their seconds, their tokens (router/routing/slo.py).
    num_steps: NotRequired[int]
    busy_s: NotRequired[float]
    num_step_tokens: NotRequired[int]


@dataclass(frozen=True, slots=True)
class CoreState:
    """The core's state after a step or a batch of commands."""

    load: EngineLoad
    stats: SchedulerStats
    adds_seen: int  # Add commands the core has taken so far


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the client learns of the model once the core is up."""

    max_model_len: int
    vocab_size: int
    hidden_size: Optional[int]  # an embedding's width (None when the config does not say)
    # Bytes of one KV block over every TP rank (K and V, every layer): what moving one block
    # of a request's KV to another engine moves (0: unknown)
    kv_bytes_per_block: int = 0


# ---- commands -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Init:
    KIND: ClassVar[Kind] = Kind.INIT
    args: dict[str, Any]  # EngineArgs.model_dump()
    eos_token_id: Optional[int]
    progress_path: Optional[str]  # the client's layer counter (`progress.ProgressCounter`)


@dataclass(frozen=True, slots=True)
class Add:
    KIND: ClassVar[Kind] = Kind.ADD
    requests: list[Request]


@dataclass(frozen=True, slots=True)
class Abort:
    KIND: ClassVar[Kind] = Kind.ABORT
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Finish:
    """Requests that a stop string ended (found by the client's detokenizer)."""

    KIND: ClassVar[Kind] = Kind.FINISH
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class AddLoRA:
    KIND: ClassVar[Kind] = Kind.ADD_LORA
    seq: int
    lora_id: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    KIND: ClassVar[Kind] = Kind.REMOVE_LORA
    seq: int
    lora_id: int


@dataclass(frozen=True, slots=True)
class Ping:
    KIND: ClassVar[Kind] = Kind.PING
    seq: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    KIND: ClassVar[Kind] = Kind.SHUTDOWN


# ---- replies --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    KIND: ClassVar[Kind] = Kind.READY
    info: CoreInfo
    state: CoreState
    progress: bool  # the core bumps the client's layer counter


@dataclass(frozen=True, slots=True)
class InitFailed:
    KIND: ClassVar[Kind] = Kind.INIT_FAILED
    message: str


@dataclass(frozen=True, slots=True)
class Step:
    KIND: ClassVar[Kind] = Kind.STEP
    result: StepResult
    state: CoreState


@dataclass(frozen=True, slots=True)
class State:
    KIND: ClassVar[Kind] = Kind.STATE
    state: CoreState


@dataclass(frozen=True, slots=True)
class Failed:
    KIND: ClassVar[Kind] = Kind.FAILED
    message: str
    dead: bool


@dataclass(frozen=True, slots=True)
class Pong:
    KIND: ClassVar[Kind] = Kind.PONG
    seq: int


@dataclass(frozen=True, slots=True)
class LoRADone:
    KIND: ClassVar[Kind] = Kind.LORA_DONE
    seq: int
    error: Optional[str]  # None: done


# What the core carries out itself (`EngineCore.apply`); the loops around it handle the rest.
CoreCommand = Union[Add, Abort, Finish, AddLoRA, RemoveLoRA]
Command = Union[Init, Add, Abort, Finish, AddLoRA, RemoveLoRA, Ping, Shutdown]
Reply = Union[Ready, InitFailed, Step, State, Failed, Pong, LoRADone]
Message = Union[Command, Reply]

_CLASSES: dict[Kind, type] = {
    cls.KIND: cls
    for cls in (
        Init,
        Add,
        Abort,
        Finish,
        AddLoRA,
        RemoveLoRA,
        Ping,
        Shutdown,
        Ready,
        InitFailed,
        Step,
        State,
        Failed,
        Pong,
        LoRADone,
    )
}
assert set(_CLASSES) == set(Kind), "every kind has its message class"


class ProtocolError(ValueError):
    """A frame that holds no message of the kind it claims."""


def encode(message: Message) -> bytes:
    """One frame's payload."""
    return pickle.dumps((int(message.KIND), message), protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> Message:
    """The message in one frame's payload; ProtocolError when it is not what it says."""
    try:
        kind, message = pickle.loads(payload)
        cls = _CLASSES[Kind(kind)]
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError, KeyError) as e:
        raise ProtocolError(f"not an engine-core message: {e}") from e
    if type(message) is not cls:
        raise ProtocolError(f"a {Kind(kind).name} frame holds a {type(message).__name__}")
    return cast(Message, message)
