"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`.

It drives an EngineCore synchronously in the calling thread (no background
thread, no Ray for TP=1): add every request, step until all are done,
accumulate the deltas into whole outputs. Nothing steps the engine between
calls, so before `generate` returns it carries out the KV connector's saves
its requests queued (a finished request's blocks are saved by the step after
it): a script that exits right after `generate` leaves its KV in the store.
`shutdown()` (or a `with LLM(...)` block) stops the engine.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from fleetserve.replica.engine.engine_args import DEFAULT_MODEL, EngineArgs
from fleetserve.replica.engine.engine_core import EngineCore
from fleetserve.replica.engine.metrics import EngineMetrics
from fleetserve.replica.engine.outputs import RequestOutput, merge_deltas
from fleetserve.replica.engine.processor import InputProcessor, OutputProcessor, PromptType
from fleetserve.replica.engine.tokenizer import apply_chat_template, load_tokenizer
from fleetserve.replica.lora.request import LoRARequest, adapter_digest, read_adapter_config
from fleetserve.replica.model_loader.model_info import generation_defaults
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.scheduler import RequestStatus, SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        self.args = EngineArgs(model=model, **engine_args)
        source = resolve_model(self.args.model)
        self.tokenizer = load_tokenizer(source)
        if self.args.chat_template is not None:
            self.tokenizer.chat_template = self.args.chat_template
        self.core = EngineCore(self.args, self.tokenizer.eos_token_id)
        self.metrics = EngineMetrics(self.args.served_name or source.name)
        self.input_processor = InputProcessor(
            self.tokenizer, self.core.max_model_len, self.core.hf_config.vocab_size, self.args.lora_table()
        )
        # --generation-config, as the server applies it: the model's own sampling defaults.
        self.generation_defaults = generation_defaults(source, self.args.generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation defaults (`generation_config`, default 'auto'),
        or plain `SamplingParams()` when it has none or `generation_config='vllm'`; what
        `generate` and `chat` use when no sampling params are given."""
        return SamplingParams(**self.generation_defaults)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """vLLM's forms: a prompt or a list of prompts, each a string, token ids,
        `{"prompt": str}` or `{"prompt_token_ids": [...]}`, mixed freely; one
        `SamplingParams` for all or a list with one per prompt. Outputs come back in
        prompt order. `lora_request` (with `LLM(..., enable_lora=True)`): one adapter for
        all prompts or one (or None) per prompt; an adapter is loaded on first use."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_list(sampling_params, len(prompts))
        loras = self._lora_names(lora_request, len(prompts))
        op = OutputProcessor(self.tokenizer, self.metrics)
        # Validate everything before adding anything: a bad prompt fails the call whole.
        batch = []
        for prompt, sp, lora in zip(prompts, params, loras):
            rid = uuid.uuid4().hex
            batch.append((rid, *self.input_processor.process(prompt, sp, rid, lora_name=lora)))
        order = [rid for rid, _, _ in batch]
        results: dict[str, RequestOutput] = {}
        for rid, text, requests in batch:
            op.add(rid, text, requests)
            for r in requests:
                self.core.add_request(r)
        bar = tqdm(total=len(batch), desc="Processed prompts", disable=not use_tqdm)
        try:
            while op.has_unfinished():
                result = self.core.step()
                self._observe_kv(result)
                if result.newly_scheduled:
                    op.mark_scheduled(result.newly_scheduled, result.timestamp)
                deltas, stopped = op.process(result.outputs)
                if stopped:
                    self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
                for delta in deltas:
                    _accumulate(results, delta)
                    if delta.finished:
                        bar.update(1)
        except BaseException as e:
            # Leave the engine clean for the next call (KeyboardInterrupt included).
            for rid in list(op.parents):
                self.core.abort_requests(op.abort(rid))
            if isinstance(e, Exception):  # (not on Ctrl-C: the next call or shutdown does it)
                try:
                    self._flush_kv()  # aborted loads' blocks back, finished requests' saves done
                except Exception:  # noqa: BLE001 - the first error is the one to raise
                    logger.exception("KV connector: flushing after a failed generate failed")
            raise
        finally:
            bar.close()
        self._flush_kv()
        return [results[rid] for rid in order]

    def _flush_kv(self) -> None:
        """Carry out what the KV connector queued for the next step (the finished requests'
        saves) now: nothing else steps this engine until the next call."""
        if self.core.kv_connector is None or not self.core.kv_pending():
            return
        left = self.core.flush_kv(on_step=self._observe_kv)
        if left:
            logger.warning(
                "KV connector: %d saves not finished within kv_save_timeout_s=%g s of "
                "generate's last output; they go on with the next call's steps, or are "
                "dropped at shutdown",
                left,
                self.core.kv_save_timeout_s,
            )

    def _observe_kv(self, result) -> None:
        if result.kv_stats:
            self.metrics.kv_transfer.observe_step(result.kv_stats)

    def shutdown(self) -> None:
        """Stop the engine: pending KV saves are carried out first (up to kv_save_timeout_s;
        the rest are logged and counted in vllm:kv_transfer_dropped_saves)."""
        dropped = self.core.shutdown()
        if dropped:
            self.metrics.kv_transfer.observe_step({"dropped_saves": dropped})

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _lora_names(self, lora_request, num_prompts: int) -> list[Optional[str]]:
        """Each prompt's adapter name (None: the base model), loading adapters not held yet."""
        if lora_request is None:
            return [None] * num_prompts
        requests = [lora_request] * num_prompts if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(requests) != num_prompts:
            raise ValueError(f"{len(requests)} LoRA requests for {num_prompts} prompts")
        held = {name: lid for name, (lid, _) in self.input_processor.loras.items()}
        for r in requests:
            if r is None:
                continue
            if not isinstance(r, LoRARequest):
                raise ValueError(f"lora_request must be LoRARequest or None, got {type(r).__name__}")
            if not self.args.enable_lora:
                raise ValueError("LoRA adapters need LLM(..., enable_lora=True)")
            if held.get(r.lora_name) == r.lora_int_id:
                continue
            if r.lora_name in held or r.lora_int_id in held.values():
                raise ValueError(
                    f"LoRARequest({r.lora_name!r}, {r.lora_int_id}): that name or id is another adapter's here"
                )
            read_adapter_config(r.lora_path)  # (the program's own paths: no --lora-roots)
            self.core.add_lora(r.lora_int_id, r.lora_name, r.lora_path)  # within --lora-load-timeout
            held[r.lora_name] = r.lora_int_id
            self.input_processor.loras[r.lora_name] = (r.lora_int_id, f"{r.lora_name}@{adapter_digest(r.lora_path)}")
        return [None if r is None else r.lora_name for r in requests]

    def chat(
        self,
        messages: Union[list[dict], Sequence[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        continue_final_message: bool = False,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, as vLLM's `LLM.chat`.
        The rendered template is tokenized without special tokens (the template has them);
        `chat_template_kwargs` are extra template variables; `continue_final_message` (with
        `add_generation_prompt=False`) goes on with the last message instead of answering it."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations: list[list[dict[str, Any]]] = (
            [list(messages)] if isinstance(messages[0], dict) else [list(conv) for conv in messages]
        )
        prompts = []
        for conv in conversations:
            text = apply_chat_template(
                self.tokenizer, conv, add_generation_prompt, chat_template_kwargs, continue_final_message
            )
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        use_tqdm: bool = True,
        truncate_prompt_tokens: Optional[int] = None,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list["EmbeddingRequestOutput"]:
        """vLLM's `LLM.embed`: each prompt's embedding, the normalized hidden state of its
        last token after the final norm (vLLM's LAST pooling; router/embeddings.py), in
        prompt order; `out.outputs.embedding` is a list of floats."""
        params = SamplingParams(
            max_tokens=1, temperature=0.0, embed=True, truncate_prompt_tokens=truncate_prompt_tokens
        )
        outs = self.generate(prompts, params, use_tqdm, lora_request)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(_embedding_of(o))) for o in outs
        ]


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)):
        return True
    # A list of ints is one tokenized prompt; an empty list is an empty prompt.
    return isinstance(prompts, (list, tuple)) and (not prompts or isinstance(prompts[0], int))


def _prompt_list(prompts) -> list:
    if _is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def _params_list(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling_params must be SamplingParams, got {type(bad).__name__}")
    return params


def _accumulate(results: dict[str, RequestOutput], delta: RequestOutput) -> None:
    acc = results.get(delta.request_id)
    if acc is None:
        acc = results[delta.request_id] = RequestOutput(
            delta.request_id, delta.prompt, delta.prompt_token_ids, [], False
        )
    merge_deltas(acc, delta)


def _embedding_of(out: RequestOutput) -> list[float]:
    """An embedding request's vector (the runner pools every prompt that asks)."""
    if out.embedding is None:
        raise RuntimeError(f"request {out.request_id} finished without its embedding")
    return out.embedding
