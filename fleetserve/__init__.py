"""fleetserve: a Ray-based LLM serving cluster.

The public Python API, as vLLM's::

    from fleetserve import LLM, SamplingParams, AsyncEngine, EngineArgs

Names are imported on first use, so `import fleetserve.scheduler` (pure Python) still
loads neither torch nor ray. The subpackages are the repository's top-level folders:
`fleetserve.scheduler`, `fleetserve.replica`, `fleetserve.router`, `fleetserve.cluster`,
`fleetserve.kv_transfer` (setup.py maps them under this one import name for an install;
in a checkout, `fleetserve/<folder>` are links to them, so type checkers, editors and
PYTHONPATH=<checkout> see the same package).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "fleetserve.replica.llm",
    "SamplingParams": "fleetserve.scheduler.sampling_params",
    "AsyncEngine": "fleetserve.replica.engine.async_engine",
    "EngineArgs": "fleetserve.replica.engine.engine_args",
    "RequestOutput": "fleetserve.replica.engine.outputs",
    "CompletionOutput": "fleetserve.replica.engine.outputs",
    "StructuredOutputsParams": "fleetserve.scheduler.structured_outputs",
    "LoRARequest": "fleetserve.replica.lora.request",
}

if TYPE_CHECKING:
    from fleetserve.replica.engine.async_engine import AsyncEngine
    from fleetserve.replica.engine.engine_args import EngineArgs
    from fleetserve.replica.engine.outputs import CompletionOutput, RequestOutput
    from fleetserve.replica.llm import LLM
    from fleetserve.replica.lora.request import LoRARequest
    from fleetserve.scheduler.sampling_params import SamplingParams
    from fleetserve.scheduler.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fleetserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["LLM", "SamplingParams", "AsyncEngine", "EngineArgs", "RequestOutput", "CompletionOutput",
           "StructuredOutputsParams", "LoRARequest"]
