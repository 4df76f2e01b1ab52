import pytest
import torch


@pytest.fixture(scope="session")
def tiny_loras(tiny_model_dir, tmp_path_factory):
    """Three PEFT adapters of the tiny model (written by `peft`): a (rank 8, all seven
    projections), b (rank 4, q and v), rs (rank 16, rslora, o/gate/down)."""
    from fleetserve.replica.testing import make_tiny_lora

    root = tmp_path_factory.mktemp("loras")
    return {
        "a": make_tiny_lora(tiny_model_dir, root / "a", seed=1),
        "b": make_tiny_lora(tiny_model_dir, root / "b", r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=2),
        "rs": make_tiny_lora(
            tiny_model_dir,
            root / "rs",
            r=16,
            lora_alpha=4,
            use_rslora=True,
            target_modules=("o_proj", "gate_proj", "down_proj"),
            seed=3,
        ),
    }


# One local Ray for the folder's tensor-parallel tests (package scope: up at the first test
# that asks, down after the folder's last test): test_families, test_moe, test_qwen3_phi3 and
# test_tp each started their own, seconds apiece on CI's two cores. 4 CPUs: one bundle per
# TP rank of the largest engine here (TP=3), plus one spare.
@pytest.fixture(scope="package")
def local_ray():
    import os

    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
        )
    yield ray
    if started:
        ray.shutdown()


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
            outs.append(seq[len(ids) :])
    return outs
