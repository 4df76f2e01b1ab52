"""The proposer a `SpeculativeConfig` names (kept apart from the interface, which the
proposers import)."""

from __future__ import annotations

from typing import Optional

import torch

from fleetserve.replica.spec_decode.config import SpeculativeConfig
from fleetserve.replica.spec_decode.draft_model import DraftModelProposer
from fleetserve.replica.spec_decode.ngram import NgramProposer
from fleetserve.replica.spec_decode.proposer import Proposer


def make_proposer(
    config: Optional[SpeculativeConfig], *, device: torch.device, dtype: torch.dtype, block_size: int, target_hf_config
) -> Optional[Proposer]:
    if config is None:
        return None
    if config.method == "ngram":
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        assert lo is not None and hi is not None, "SpeculativeConfig sets both for ngram"
        return NgramProposer(config.num_speculative_tokens, lo, hi)
    assert config.model is not None, "SpeculativeConfig requires a model for draft_model"
    return DraftModelProposer(
        config.model,
        config.num_speculative_tokens,
        device=device,
        dtype=dtype,
        block_size=block_size,
        target_hf_config=target_hf_config,
    )
