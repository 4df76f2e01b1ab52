import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Two cores shared by everything: tests take one thread each.
    torch.set_num_threads(1)



def hf_greedy(model_dir, prompts_ids, max_new_tokens, dtype=torch.float32):
    """Reference greedy continuation with HF transformers (full recompute, no cache)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts_ids:
            seq = list(ids)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            outs.append(seq[len(ids):])
    return outs
