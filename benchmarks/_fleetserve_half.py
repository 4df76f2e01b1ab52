"""fleetserve's adapter for benchmarks/_traces.py."""

from __future__ import annotations

from fleetserve.scheduler import (
    CacheConfig,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    SchedulerConfig,
    create_scheduler,
)


class FleetserveAdapter:
    name = "fleetserve"

    def build(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, prefix_caching):
        self._last_total = 0
        return create_scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
            ),
            CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        )

    def make_request(self, rid, prompt, max_tokens):
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=0)

    def add_request(self, sched, request):
        sched.add_request(request)

    def schedule(self, sched):
        so = sched.schedule()
        self._last_total = so.total_num_scheduled_tokens
        return so

    def fake_runner_output(self, sched, so, step):
        reqs = sched.requests
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for i, rid in enumerate(ids):
            r = reqs[rid]
            sampled.append([(step * 31 + i) % 29000 + 1] if r.num_computed_tokens >= r.num_tokens else [])
        return ModelRunnerOutput(ids, sampled)

    def update(self, sched, so, ro):
        sched.update_from_output(so, ro)

    def num_running(self, sched):
        return len(sched.running)

    def last_total(self, sched):
        return self._last_total
