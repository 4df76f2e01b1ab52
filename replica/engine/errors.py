"""The engine's errors that callers catch, in a module without torch: the router's replica
deployment (and the CLI process that deploys it) imports them without loading the model code."""


class QueueFullError(RuntimeError):
    """The replica's bounded waiting queue is full; try again later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine hit an unrecoverable error (e.g. a worker died); restart the replica."""


class LoRACapacityError(QueueFullError):
    """Every LoRA adapter the engine may hold (--max-cpu-loras) is in use by running requests,
    so another cannot be loaded now; try again later (HTTP 429)."""
