"""LoRA adapters served beside the base model (vLLM's --enable-lora / --lora-modules).

request.py   LoRARequest and the adapter list of an engine (no torch: the scheduler,
             the processor and the router read them)
adapter.py   a PEFT adapter folder -> per-module (A, B) weights, checked against the model
layers.py    the per-step batch of adapters and the delta each linear adds:
             y[rows of adapter i] += (x A_i^T) (s_i B_i)^T
stack.py     every linear's adapters in fixed buffers, picked per row by a one-hot:
             what decode steps replayed from CUDA graphs run
"""

from fleetserve.replica.lora.request import LoRAModulePath, LoRARequest

__all__ = ["LoRAModulePath", "LoRARequest"]
