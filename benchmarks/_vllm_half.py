"""vLLM's half of benchmarks/scheduler_overhead.py: the same traces through vLLM's
own v1 `Scheduler`, built without a GPU or a model hub the way vLLM's CPU tests
build one (tests/v1/core/utils.py), from a tiny local HF config.

Run in-process when `import vllm` works, else as a script with the vLLM
interpreter: it reads one trace job per stdin line and answers one JSON line each.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def _tiny_model_dir() -> str:
    """A config-only Llama folder: ModelConfig needs one, no weights are read."""
    path = os.path.join(tempfile.gettempdir(), "fleetserve-bench-tiny-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        from transformers import LlamaConfig

        LlamaConfig(
            vocab_size=32000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=8192,
        ).save_pretrained(path)
    return path


def build_scheduler(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    prefix_caching: bool,
):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(
        model=_tiny_model_dir(), dtype="float16", seed=42, skip_tokenizer_init=True, max_model_len=max_model_len
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )
    cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )


class VllmAdapter:
    name = "vllm"

    def build(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, prefix_caching):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        sched = build_scheduler(
            num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, prefix_caching
        )
        self._hasher = None
        if prefix_caching:
            # What vLLM's EngineCore does: the configured hash (sha256 by default).
            hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self._hasher = get_request_block_hasher(block_size, hash_fn)
        self._last_total = 0
        return sched

    def make_request(self, rid, prompt, max_tokens):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(
            rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, block_hasher=self._hasher
        )

    def add_request(self, sched, request):
        sched.add_request(request)

    def schedule(self, sched):
        so = sched.schedule()
        self._last_total = so.total_num_scheduled_tokens
        return so

    def fake_runner_output(self, sched, so, step):
        from vllm.v1.outputs import ModelRunnerOutput

        reqs = sched.requests
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for i, rid in enumerate(ids):
            r = reqs[rid]
            sampled.append([(step * 31 + i) % 29000 + 1] if r.num_computed_tokens >= r.num_tokens else [])
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )

    def update(self, sched, so, ro):
        sched.update_from_output(so, ro)

    def num_running(self, sched):
        return len(sched.running)

    def last_total(self, sched):
        return self._last_total


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def main() -> None:
    """Subprocess mode: one JSON job {"spec": ..., "repeats": R} per stdin line,
    one JSON result per stdout line (prefixed), so the caller can interleave
    traces with its own and both halves see the same machine load."""
    import logging

    logging.disable(logging.WARNING)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _traces import run_trace

    print("@@READY@@" + json.dumps({"version": vllm_version()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        result = run_trace(job["spec"], VllmAdapter(), job["repeats"])
        print("@@RESULT@@" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
