"""Tiny, real, offline Llama models for tests.

`make_tiny_llama(path)` writes a complete HF model folder -- config.json,
model.safetensors (random weights from a seeded `transformers.LlamaForCausalLM`)
and a real byte-level BPE tokenizer trained in memory with a ChatML chat
template -- so every layer of the stack (weight loading, tokenizer,
detokenizer, chat formatting, the HTTP API) can be exercised without a model
hub or the real checkpoint. Same arguments, same seed -> byte-identical
weights and the same tokenizer. It takes well under a second once
transformers is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

# The special tokens, ids and roles as SmolLM2 has them: <|im_start|> is bos,
# <|im_end|> is eos and pad.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>"
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "A language model predicts the next token from the tokens before it.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "The scheduler hands out a token budget every step; prefill and decode share it.",
    "Once upon a time there was a little robot who liked to count: one, two, three, four, five.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = < > ( ) [ ] { } # @ & % $",
    "system\nYou are a helpful assistant.\nuser\nWhat is the capital of France?\nassistant\nParis.",
    "Ray Serve routes requests to replicas; each replica runs an engine core with a scheduler.",
]


def _train_tokenizer(target_size: Optional[int]):
    """A byte-level BPE tokenizer (any text round-trips) of exactly `target_size` ids.

    BPE training on a small corpus may stop short of the target; the rest is
    filled with plain (non-special) added tokens so every id the model can
    sample decodes to some text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base_size = 384 if target_size is None else target_size
    min_size = 256 + len(SPECIAL_TOKENS)
    if base_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size} (256 bytes + special tokens), got {base_size}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
    )
    # Repeat the corpus a few times so merges have counts; order is fixed -> deterministic.
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    missing = base_size - len(fast)
    if missing > 0:
        fast.add_tokens([f"<extra_{i}>" for i in range(missing)])
    assert fast.convert_tokens_to_ids(BOS_TOKEN) == BOS_TOKEN_ID
    assert fast.convert_tokens_to_ids(EOS_TOKEN) == EOS_TOKEN_ID
    return fast


def tiny_llama_config(
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: Optional[int] = None,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: Optional[int] = None,
    rope_theta: float = 10000.0,
    rope_scaling: Optional[dict[str, Any]] = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    max_position_embeddings: int = 2048,
    rms_norm_eps: float = 1e-5,
    architecture: str = "LlamaForCausalLM",
):
    """The `transformers.LlamaConfig` that `make_tiny_llama` writes (no files)."""
    from transformers import LlamaConfig

    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope_parameters.update(rope_scaling)
        rope_parameters["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        rope_parameters.pop("type", None)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size + hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_parameters=rope_parameters,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=attention_bias,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        architectures=[architecture],
    )


def make_tiny_llama(
    path: str | Path,
    *,
    vocab_size: Optional[int] = None,
    hidden_size: int = 64,
    intermediate_size: Optional[int] = None,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: Optional[int] = None,
    rope_theta: float = 10000.0,
    rope_scaling: Optional[dict[str, Any]] = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    max_position_embeddings: int = 2048,
    rms_norm_eps: float = 1e-5,
    init_std: float = 0.1,
    seed: int = 0,
) -> Path:
    """Write a tiny random Llama HF folder at `path` (created if needed) and return it.

    vocab_size=None uses the tokenizer's natural size (384). `init_std` is
    larger than HF's 0.02 so that logits differ visibly between tokens (greedy
    outputs are then not all one token and numerical bugs are not hidden by
    near-uniform distributions). `attention_bias=True` gives Qwen2-style q/k/v
    biases (and, in HF's Llama, an o_proj bias, which our model also loads).
    """
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=attention_bias,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
    )
    config.initializer_range = init_std

    # A private generator: seeding must not disturb (or depend on) the caller's RNG.
    gen = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_model(
    path: str | Path,
    config: Any,
    *,
    init_std: float = 0.1,
    norm_center: float = 1.0,
    seed: int = 0,
) -> Path:
    """Write a tiny random HF folder of any architecture: `config` is a transformers config
    object (Qwen3Config(...), Gemma3TextConfig(...), ...; its `vocab_size` and special token
    ids are set to the tiny tokenizer's), the model is transformers' own class for it (AutoModelForCausalLM), with
    seeded random weights as in `make_tiny_llama` (norm weights around `norm_center`: 1 for
    `x * w` norms, 0 for Gemma's `x * (1 + w)`), saved with `save_pretrained`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(None)
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_TOKEN_ID, EOS_TOKEN_ID, EOS_TOKEN_ID
    config.initializer_range = init_std
    gen = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_lora(
    model_dir: str | Path,
    path: str | Path,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    use_rslora: bool = False,
    init_std: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write a PEFT LoRA adapter folder for the tiny model at `model_dir` (written by `peft`
    itself: its adapter_config.json and its key names), with random A and B (PEFT starts B
    at zero, which would make the adapter a no-op) large enough to change greedy outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(path)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(str(path))
    return path
