"""The model runner: SchedulerOutput in, one forward pass, ModelRunnerOutput out.

It keeps a persistent batch: a request's prompt, sampling params and block
table arrive once (`scheduled_new_reqs`); later steps send only new tokens
and new block ids (`scheduled_cached_reqs`). Tokens of all scheduled requests
are flattened in one forward (prefill chunks and decodes mixed, no padding):

    req A (prefill chunk, context 32):  tokens 32..95   -> no sample (prompt continues)
    req B (decode, context 120):        token 120       -> sample
    req C (last prefill chunk):         tokens 64..70   -> sample

Only the last position of a request that reaches the end of its known tokens
is turned into logits and sampled. With speculative decoding, a request's
draft tokens follow its known tokens in the same forward, and every one of
those positions is sampled (`_sample_and_verify`); a proposer then suggests
the next drafts (replica/spec_decode/).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.layers.sampler import (
    RequestSamplingTensors,
    Sampler,
    SamplingBatch,
    compute_prompt_logprobs,
    make_generator,
)
from fleetserve.replica.lora import layers as lora_layers
from fleetserve.replica.model_loader.weights import allocate_kv_caches, kv_cache_bytes_per_block, load_model
from fleetserve.replica.spec_decode.proposer import ProposeInput, Proposer
from fleetserve.scheduler import ModelRunnerOutput, SamplingParams, SchedulerOutput

if TYPE_CHECKING:
    from fleetserve.kv_transfer.base import KVConnectorWorker
    from fleetserve.replica.lora.stack import LoRAStacks
    from fleetserve.replica.worker.cuda_graph import DecodeGraphs

logger = logging.getLogger(__name__)

# Why a request failed whose masks left no token to sample (ModelRunnerOutput.sampling_errors).
NO_TOKEN_LEFT = (
    "no token can be sampled: the request's constraints (allowed_token_ids, its grammar, "
    "bad_words, min_tokens) together forbid every token"
)


@dataclass
class PreparedLoRA:
    """An adapter read and cut into this rank's slots, not attached yet (prepare_lora_adapter)."""

    lora_id: int
    name: str
    path: str
    rank: int
    targets: list[str]
    slots: dict


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    token_ids: list[int]  # prompt + output, as known to this worker
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator]
    lora_id: int = 0  # the LoRA adapter it runs with (0: the base model)
    # Its logit_bias / allowed_token_ids as tensors, built once when it is added (None: neither).
    sampling_tensors: Optional[RequestSamplingTensors] = None


@dataclass(slots=True)
class _StepBatch:
    """One step's requests (in forward order) and their flattened tokens."""

    req_ids: list[str]
    states: list[CachedRequestState]
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)  # tokens of each request this step
    context_lens: list[int] = field(default_factory=list)  # tokens each request had computed before
    sample_rows: list[int] = field(default_factory=list)  # index into req_ids of the rows that sample
    sample_drafts: list[Sequence[int]] = field(default_factory=list)  # each sampled row's drafts (most often none)
    logits_index: list[int] = field(default_factory=list)  # flattened token index of each sampled position


class _EagerInputs(NamedTuple):
    """What an eager forward ran on (a draft model replays it)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata


class ModelRunner:
    def __init__(
        self,
        model,
        hf_config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        eos_token_id: Optional[int],
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.tp_size = tp_size
        # Only rank 0 samples; the other ranks take part in the collectives only.
        self.is_driver = tp_rank == 0
        self.vocab_size = hf_config.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list = []
        self.num_blocks = 0
        # Speculative decoding: set by the worker (None: off).
        self.proposer: Optional[Proposer] = None
        # A KV connector that moves KV layer by layer (its hooks run around each layer of the
        # forward); set by the worker only for a connector that asks (None: no per-layer call).
        self.kv_hooks: Optional[KVConnectorWorker] = None
        # CUDA graphs of decode steps (worker/cuda_graph.py); None: every step runs eagerly.
        self.decode_graphs: Optional[DecodeGraphs] = None
        # LoRA adapters attached to the model's linears: lora_id -> name (add_lora_adapter).
        self.lora_adapters: dict[int, str] = {}
        # The same adapters in fixed buffers, for decode steps replayed from CUDA graphs
        # (lora/stack.py); None: steps with adapters run eagerly.
        self.lora_stacks: Optional[LoRAStacks] = None

    @classmethod
    def load(
        cls,
        source,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        eos_token_id: Optional[int],
        tp_size: int = 1,
        tp_rank: int = 0,
        enable_expert_parallel: bool = False,
    ) -> "ModelRunner":
        model, hf_config = load_model(source, dtype, device, enable_expert_parallel=enable_expert_parallel)
        return cls(
            model,
            hf_config,
            device=device,
            dtype=dtype,
            block_size=block_size,
            eos_token_id=eos_token_id,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )

    # ---- LoRA ------------------------------------------------------------------
    def add_lora_adapter(self, lora_id: int, name: str, path: str, max_lora_rank: int) -> None:
        """Load a PEFT adapter and attach this rank's shard of it as `lora_id` (ValueError when
        the adapter does not fit the model or --max-lora-rank)."""
        self.install_lora_adapter(self.prepare_lora_adapter(lora_id, name, path, max_lora_rank))

    def prepare_lora_adapter(self, lora_id: int, name: str, path: str, max_lora_rank: int) -> "PreparedLoRA":
        """Read and check an adapter and cut this rank's slots of it, on the CPU (the costly part
        of a load: safe on another thread while steps run, it touches nothing a forward reads
        and does no CUDA work)."""
        from fleetserve.replica.lora.adapter import load_lora, shard

        if lora_id < 1:
            raise ValueError(f"LoRA adapter ids start at 1, got {lora_id}")
        adapter = load_lora(name, path, self.hf_config, max_lora_rank)
        slots = shard(self.model, adapter, self.dtype, torch.device("cpu"))  # the device copy: at install
        return PreparedLoRA(lora_id, name, path, adapter.rank, adapter.targets, slots)

    def install_lora_adapter(self, prepared: "PreparedLoRA") -> None:
        """Attach a prepared adapter (between steps: its slots copied to the model's device, the
        linears' references, and its slot of the CUDA-graph stacks when they are on)."""
        from fleetserve.replica.lora.adapter import install

        lora_id = prepared.lora_id
        install(self.model, lora_id, prepared.slots, self.device)
        self.lora_adapters[lora_id] = prepared.name
        if self.lora_stacks is not None and self.lora_stacks.put(lora_id) and self.decode_graphs is not None:
            self.decode_graphs.set_lora_slots(self.lora_stacks.capacity)  # the buffers moved
        logger.info(
            "LoRA adapter %r (id %d, rank %d, %s) from %s",
            prepared.name,
            lora_id,
            prepared.rank,
            "/".join(prepared.targets),
            prepared.path,
        )

    def remove_lora_adapter(self, lora_id: int) -> None:
        from fleetserve.replica.lora.adapter import detach

        if self.lora_stacks is not None:
            self.lora_stacks.drop(lora_id)
        detach(self.model, lora_id)
        self.lora_adapters.pop(lora_id, None)

    # ---- KV cache ------------------------------------------------------------
    def bytes_per_block(self) -> int:
        own = kv_cache_bytes_per_block(self.hf_config, self.block_size, self.dtype, self.tp_size)
        return own + (self.proposer.bytes_per_block() if self.proposer is not None else 0)

    def initialize_kv_cache(self, num_blocks: int, decode_graphs=None) -> None:
        """`decode_graphs` (a cuda_graph.DecodeGraphConfig): replay decode steps from CUDA graphs;
        the cache then holds one scratch block past `num_blocks` for the graphs' padded rows."""
        extra = 1 if decode_graphs is not None else 0
        self.decode_graphs = None
        if self.lora_stacks is not None:
            self.lora_stacks.release()
            self.lora_stacks = None
        self.kv_caches = allocate_kv_caches(
            self.hf_config, num_blocks + extra, self.block_size, self.dtype, self.device, self.tp_size
        )
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        if decode_graphs is not None:
            from dataclasses import replace

            from fleetserve.replica.worker.cuda_graph import DecodeGraphs

            if decode_graphs.lora_slots:
                from fleetserve.replica.lora.stack import LoRAStacks

                self.lora_stacks = LoRAStacks(
                    self.model,
                    max(decode_graphs.lora_slots, len(self.lora_adapters)),
                    decode_graphs.max_lora_rank,
                    self.dtype,
                    self.device,
                )
                for lora_id in sorted(self.lora_adapters):
                    self.lora_stacks.put(lora_id)
                decode_graphs = replace(decode_graphs, lora_slots=self.lora_stacks.capacity)
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                scratch_block=num_blocks,
                block_size=self.block_size,
                config=decode_graphs,
                device=self.device,
                dtype=self.dtype,
            )

    # ---- persistent batch -------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = make_generator(sp.seed, self.device) if sp.seed is not None else None
            output = list(new.output_token_ids)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                new.prompt_token_ids,
                output,
                new.prompt_token_ids + output,
                sp,
                list(new.block_ids),
                new.num_computed_tokens,
                gen,
                new.lora_id,
                RequestSamplingTensors.build(sp, self.vocab_size, self.device) if self.is_driver else None,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_token_ids:
                state.output_token_ids.extend(cached.new_token_ids)
                state.token_ids.extend(cached.new_token_ids)
            if cached.new_block_ids:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        batch = self._prepare_inputs(so)
        hidden, eager = self._forward(batch)
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: dict[str, list] = {}
        errors: dict[str, str] = {}
        pooled = None
        if batch.sample_rows and self.is_driver:
            pooled = self._embeddings(
                batch.req_ids, batch.states, batch.sample_rows, batch.sample_drafts, batch.logits_index, hidden
            )
        if batch.sample_rows:  # every rank: the LM head's all-gather is a collective
            logits = self.model.compute_logits(
                hidden[torch.tensor(batch.logits_index, dtype=torch.long, device=self.device)]
            )
            if self.is_driver:
                self._sample_rows(batch, logits, so.structured_output, sampled, logprobs, errors)
        prompt_logprobs = self._prompt_logprobs(
            batch.req_ids, batch.states, batch.query_lens, batch.context_lens, hidden
        )
        drafts_out = None
        if self.proposer is not None and self.is_driver:
            drafts_out = self._propose(self.proposer, batch, sampled, eager)
        return ModelRunnerOutput(
            batch.req_ids,
            sampled,
            logprobs or None,
            prompt_logprobs or None,
            spec_token_ids=drafts_out,
            pooler_output=pooled,
            sampling_errors=errors or None,
        )

    def _prepare_inputs(self, so: SchedulerOutput) -> _StepBatch:
        """The step's tokens, flattened request by request (see the module doc)."""
        req_ids = list(so.num_scheduled_tokens)
        if self.lora_adapters:  # each adapter's rows side by side: one slice per adapter
            req_ids.sort(key=lambda rid: self.requests[rid].lora_id)
        batch = _StepBatch(req_ids, [self.requests[rid] for rid in req_ids])
        spec = so.scheduled_spec_decode_tokens
        offset = 0
        for i, (rid, state) in enumerate(zip(req_ids, batch.states)):
            n = so.num_scheduled_tokens[rid]
            start = state.num_computed_tokens
            drafts: Sequence[int] = spec.get(rid, ()) if spec else ()
            known = n - len(drafts)
            batch.input_ids.extend(state.token_ids[start : start + known])
            batch.input_ids.extend(drafts)
            batch.positions.extend(range(start, start + n))
            batch.query_lens.append(n)
            batch.context_lens.append(start)
            offset += n
            if start + known >= len(state.token_ids):
                batch.sample_rows.append(i)
                batch.sample_drafts.append(drafts)
                # The last known token and every draft: each predicts the next token.
                batch.logits_index.extend(range(offset - len(drafts) - 1, offset))
            # The scheduler advanced its counter optimistically; mirror it.
            state.num_computed_tokens = start + n
        return batch

    def _forward(self, batch: _StepBatch) -> tuple[torch.Tensor, Optional[_EagerInputs]]:
        """The model over the step's tokens: hidden states [num_tokens, hidden], and the eager
        inputs (None when a CUDA graph replayed the step)."""
        states, device = batch.states, self.device
        lora_ids = [s.lora_id for s in states] if self.lora_adapters else None
        lora_batch = lora_layers.LoRABatch.build(lora_ids, batch.query_lens, device) if lora_ids else None
        if lora_batch is None:
            lora_ids = None  # no request of this step has an adapter
        stacks = self.lora_stacks
        stacks_hold = lora_ids is not None and stacks is not None and stacks.holds(lora_ids)
        graphs = self.decode_graphs
        graph_key = None
        if (
            graphs is not None
            and len(batch.input_ids) == len(batch.req_ids)  # one token per request
            and self.kv_hooks is None
            and self.proposer is None
            and (lora_ids is None or stacks_hold)
        ):
            graph_key = graphs.bucket(len(batch.req_ids), -(-(max(batch.positions) + 1) // self.block_size))
        if graphs is not None and graph_key is not None:
            onehot = stacks.onehot(lora_ids) if stacks is not None and lora_ids else None
            return graphs.run(graph_key, batch.input_ids, batch.positions, [s.block_ids for s in states], onehot), None
        if (
            stacks is not None
            and lora_ids is not None
            and stacks_hold
            and lora_batch is not None
            and len(lora_batch.groups) > 1
        ):
            # An eager step with several adapters, on a GPU (stacks exist only with graphs): the
            # stacked buffers take them all in three kernels per linear, not two per adapter.
            onehot = stacks.onehot(lora_ids).repeat_interleave(torch.tensor(batch.query_lens), dim=0)
            lora_batch = lora_layers.LoRABatch.stacked(onehot.to(device))
        eager = _EagerInputs(
            torch.tensor(batch.input_ids, dtype=torch.long, device=device),
            torch.tensor(batch.positions, dtype=torch.long, device=device),
            AttentionMetadata.build(
                batch.query_lens,
                batch.context_lens,
                [s.block_ids for s in states],
                self.block_size,
                device,
                request_ids=batch.req_ids,
            ),
        )
        with lora_layers.active(lora_batch):
            hidden = self.model(eager.input_ids, eager.positions, self.kv_caches, eager.attn_metadata, self.kv_hooks)
        return hidden, eager

    def _sample_rows(
        self,
        batch: _StepBatch,
        logits: torch.Tensor,
        structured_output: Any,
        sampled: list[list[int]],
        logprobs: dict[str, list],
        errors: dict[str, str],
    ) -> None:
        """Sample (and verify drafts of) the rows that reach the end of their tokens, into
        `sampled` (per request of the batch) and `logprobs` (per request id that asked); a
        request whose masks left no token to sample gets an entry in `errors` and only the
        tokens before the position that failed (most often none)."""
        rows = batch.sample_rows
        tokens, entries, failed = self._sample_and_verify(
            logits,
            [batch.states[i] for i in rows],
            batch.sample_drafts,
            [batch.req_ids[i] for i in rows],
            structured_output,
        )
        for j, i in enumerate(rows):
            if j in failed:
                errors[batch.req_ids[i]] = NO_TOKEN_LEFT
                logger.warning("request %s: %s", batch.req_ids[i], NO_TOKEN_LEFT)
            sampled[i] = tokens[j]
            if entries[j] is not None:
                logprobs[batch.req_ids[i]] = entries[j]

    def _propose(
        self, proposer: Proposer, batch: _StepBatch, sampled: list[list[int]], eager: Optional[_EagerInputs]
    ) -> dict[str, list[int]]:
        """Drafts for the next step. Constrained requests get none: their grammar mask is for
        one position."""
        assert eager is not None, "decode graphs are off with a proposer: its steps run eagerly"
        states = batch.states
        got = [
            i
            for i in batch.sample_rows
            if sampled[i] and getattr(states[i].sampling_params, "structured_outputs", None) is None
        ]
        return proposer.propose(
            ProposeInput(
                eager.input_ids,
                eager.positions,
                eager.attn_metadata,
                [batch.req_ids[i] for i in got],
                [states[i].token_ids + sampled[i] for i in got],
                [states[i].block_ids for i in got],
            )
        )

    @staticmethod
    def _embeddings(req_ids, states, sample_rows, sample_drafts, logits_index, hidden) -> Optional[dict]:
        """SamplingParams.embed: the L2-normalized hidden state (after the final norm) of the
        prompt's last token, for requests whose prompt ends in this step."""
        out = {}
        at = 0  # into logits_index: each sampled row's positions, drafts after the known token
        for i, drafts in zip(sample_rows, sample_drafts):
            state = states[i]
            if state.sampling_params.embed and not state.output_token_ids:
                vector = torch.nn.functional.normalize(hidden[logits_index[at]].float(), dim=-1)
                out[req_ids[i]] = vector.tolist()
            at += len(drafts) + 1
        return out or None

    def _sample_and_verify(
        self,
        logits: torch.Tensor,
        rows: list[CachedRequestState],
        drafts: list,
        row_ids: list[str],
        structured_output=None,
    ) -> tuple[list[list[int]], list, set[int]]:
        """Sample every position of every row; keep each row's drafts while they
        equal what the target sampled, plus the target's token after them.

        Position j of a row is sampled exactly as plain decoding would sample
        that token: its own sampling params, the outputs so far plus drafts[:j]
        (penalties, min_tokens), the seeded draw of that output position. If
        drafts[:j] were accepted, they are the tokens plain decoding would have
        produced, so position j's token has the same distribution as plain
        decoding's. With a deterministic draft x (n-gram, greedy draft model)
        this is rejection sampling with a point-mass proposal: x is accepted
        with probability p(x), and on rejection the token is drawn from p
        restricted to tokens != x -- the target distribution, exactly; greedy
        output is identical token for token. Returns (tokens, logprobs
        entries or None) per row, and the rows that failed: a position that
        would be used (its drafts before it all accepted) had no token left
        to sample (contradictory masks); such a row keeps the tokens before
        that position. Constrained (grammar) requests never
        carry drafts, so their one position takes the step's bitmask row.
        A request's logit_bias / allowed_token_ids tensors, built when it was
        added, serve all of its positions."""
        params, prompts, outputs, generators, mask_ids, tensors = [], [], [], [], [], []
        for s, d, rid in zip(rows, drafts, row_ids):
            for j in range(len(d) + 1):
                mask_ids.append(rid if j == 0 else "")
                params.append(s.sampling_params)
                prompts.append(s.prompt_token_ids)
                outputs.append(s.output_token_ids + list(d[:j]) if j else s.output_token_ids)
                generators.append(self._generator_at(s, len(s.output_token_ids) + j, j == 0))
                tensors.append(s.sampling_tensors)
        batch = SamplingBatch.build(
            params, prompts, outputs, generators, self.eos_token_id, self.vocab_size, self.device, tensors
        )
        if structured_output is not None:
            batch.token_bitmask = structured_output.for_rows(mask_ids, self.device)
        out = self.sampler(logits, batch)
        dead = set(out.failed_rows)
        tokens, entries, failed = [], [], set()
        r = 0
        for k, d in enumerate(drafts):
            row = out.sampled_token_ids[r : r + len(d) + 1]
            num = 1
            while num <= len(d) and row[num - 1] == d[num - 1]:
                num += 1
            if dead:  # plain decoding would have stopped at the first used position that failed
                stop = next((j for j in range(num) if r + j in dead), None)
                if stop is not None:
                    failed.add(k)
                    num = stop
            tokens.append(row[:num])
            lp = out.logprobs[r : r + num]
            entries.append(None if not lp or lp[0] is None else lp)
            r += len(d) + 1
        return tokens, entries, failed

    def _generator_at(self, s: CachedRequestState, position: int, reuse: bool) -> Optional[torch.Generator]:
        """The seeded request's generator for output `position`: seeded from
        (seed, position), so a token's draw is the same whatever the batch, a
        preemption or speculation did."""
        if s.generator is None or s.sampling_params.seed is None:
            return None
        seed = (s.sampling_params.seed * 1_000_003 + position) % (1 << 63)
        if reuse:
            s.generator.manual_seed(seed)
            return s.generator
        return make_generator(seed, self.device)

    def _prompt_logprobs(self, req_ids, states, query_lens, context_lens, hidden) -> dict:
        """Logprobs of prompt tokens 1.. for requests that asked, chunk by chunk."""
        out = {}
        offset = 0
        for rid, state, n, start in zip(req_ids, states, query_lens, context_lens):
            num = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            if num is not None and start < num_prompt and not state.output_token_ids:
                # Positions start..start+n-1 predict tokens start+1..start+n (within the prompt).
                end = min(start + n, num_prompt - 1)
                if end > start:
                    logits = self.model.compute_logits(hidden[offset : offset + end - start])
                    targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
                    out[rid] = compute_prompt_logprobs(logits, targets, num)
                else:
                    out[rid] = []
            offset += n
        return out
