"""What the mixture-of-experts families (Mixtral, Qwen3-MoE) share over Llama's classes:
expert weights from checkpoints, expert parallelism as a constructor switch, and the
decoder layers run as modules.

Checkpoint forms accepted for one layer's experts (`<layer>.mlp.experts`):

- per expert, as the Hub's checkpoints and transformers' save_pretrained write them:
  `experts.N.<gate>.weight` [I, H], `experts.N.<up>.weight` [I, H], `experts.N.<down>.weight`
  [H, I], the pieces named by the family (`expert_pieces`: Mixtral w1/w3/w2, Qwen3-MoE
  gate_proj/up_proj/down_proj);
- fused, as transformers 5 holds them in its modules: `experts.gate_up_proj` [E, 2I, H]
  (gate rows, then up rows) and `experts.down_proj` [E, H, I]; these are split into the
  per-expert names first, so completeness is checked per expert either way.

A family's older module names (`checkpoint_renames`: Mixtral's `block_sparse_moe`) are
renamed to ours (`mlp`) before loading; names in errors are ours.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterable, Iterator, Optional

import torch

from fleetserve.replica.distributed.parallel import TPGroup
from fleetserve.replica.layers.moe import DOWN, GATE, UP, FusedMoE
from fleetserve.replica.models.llama import LlamaForCausalLM, LlamaModel, _KernelPlan

_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<piece>\w+)\.weight$")


class MoEModel(LlamaModel):
    """LlamaModel whose layers always run as modules: the fused `llama_layers` CPU kernel is
    Llama's dense layer only."""

    def _kernel_plan(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor]) -> Optional[_KernelPlan]:
        return None


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-shaped causal LM with FusedMoE layers; `enable_expert_parallel` puts whole
    experts on each TP rank instead of slicing every expert (replica.layers.moe)."""

    supports_expert_parallel = True
    # FusedMoE reads each expert's token count on the host (a sync no CUDA graph can capture)
    cuda_graphs = False
    # checkpoint piece under experts.N -> shard (GATE, UP, DOWN); a family sets its own
    expert_pieces: dict[str, int] = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
    # (old, new) substrings of checkpoint names, applied before anything else
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        config: Any,
        tp_group: Optional[TPGroup] = None,
        max_position: Optional[int] = None,
        enable_expert_parallel: bool = False,
    ):
        # The layers read the switch from the config they are built with; the caller's config
        # object is left as it was.
        config = copy.copy(config)
        config.enable_expert_parallel = bool(enable_expert_parallel)
        super().__init__(config, tp_group, max_position)

    # ----------------------------------------------------------------------- weights

    def _piece_names(self) -> dict[int, str]:
        return {shard: piece for piece, shard in self.expert_pieces.items()}

    def _target(self, hf_name: str) -> tuple[str, Any]:
        m = _EXPERT_NAME.match(hf_name)
        if m is not None and m["piece"] in self.expert_pieces:
            shard = self.expert_pieces[m["piece"]]
            param = "w2_weight" if shard == DOWN else "w13_weight"
            return f"{m['prefix']}.{param}", (int(m["expert"]), shard)
        return super()._target(hf_name)

    def _canonical(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint entries under our names, fused expert tensors split per expert."""
        pieces = self._piece_names()
        for name, tensor in weights:
            for old, new in self.checkpoint_renames:
                name = name.replace(old, new)
            if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]
                prefix = name[: -len("gate_up_proj")]
                if tensor.dim() != 3 or tensor.shape[1] % 2:
                    raise ValueError(f"{name}: expected [experts, 2 x intermediate, hidden], got {tuple(tensor.shape)}")
                half = tensor.shape[1] // 2
                for e in range(tensor.shape[0]):
                    yield f"{prefix}{e}.{pieces[GATE]}.weight", tensor[e, :half]
                    yield f"{prefix}{e}.{pieces[UP]}.weight", tensor[e, half:]
            elif name.endswith(".experts.down_proj"):  # [E, H, I]
                prefix = name[: -len("down_proj")]
                if tensor.dim() != 3:
                    raise ValueError(f"{name}: expected [experts, hidden, intermediate], got {tuple(tensor.shape)}")
                for e in range(tensor.shape[0]):
                    yield f"{prefix}{e}.{pieces[DOWN]}.weight", tensor[e]
            else:
                yield name, tensor

    def expected_weight_names(self) -> set[str]:
        """Llama's, with each layer's stacked expert weights as the per-expert checkpoint names."""
        pieces = self._piece_names()
        names: set[str] = set()
        for name in super().expected_weight_names():
            for param, shards in (("w13_weight", (GATE, UP)), ("w2_weight", (DOWN,))):
                if name.endswith(f".experts.{param}"):
                    prefix = name[: -len(param) - 1]
                    moe = self.get_submodule(prefix)
                    assert isinstance(moe, FusedMoE)
                    names.update(f"{prefix}.{e}.{pieces[s]}.weight" for e in range(moe.num_experts) for s in shards)
                    break
            else:
                names.add(name)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> set[str]:
        return super().load_weights(self._canonical(weights), source)
