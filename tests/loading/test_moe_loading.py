"""Mixture-of-experts checkpoints load to transformers' logits: safetensors with the
Hub's per-expert keys (sharded), and GGUF files with llama.cpp's stacked experts.

Tolerances: f32 weights vs transformers 1e-4 max abs; f16 weights (run in f32 by the
native kernels) vs transformers on the same f16-exact weights 1e-4.
"""

import pytest
import torch
from moe_helpers import MOE_CONFIGS, hub_state_dict, save_hub_dir, tiny_moe_model

from llmrun.loading.loader import load_model

pytest.importorskip("transformers")
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 403, 407, 261, 378, 5, 90, 300, 17, 2, 44, 501, 7, 8, 99, 123]])
POSITIONS = torch.arange(IDS.shape[1])[None]


def logits(path, dtype="f32"):
    with torch.no_grad():
        return load_model(path, CPU, dtype).model(IDS, POSITIONS)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_sharded_per_expert_safetensors(name, tmp_path):
    hf, config = tiny_moe_model(name)
    with torch.no_grad():
        expected = hf(IDS).logits
    state = hub_state_dict(hf, config["model_type"])
    hub = save_hub_dir(tmp_path / "hub", config, state, shards=3)
    torch.testing.assert_close(logits(hub), expected, atol=1e-4, rtol=0)
    # What transformers' save_pretrained writes loads the same.
    hf.save_pretrained(tmp_path / "saved")
    torch.testing.assert_close(logits(tmp_path / "saved"), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_f16_safetensors_experts(name, tmp_path):
    """Half experts stay half on the CPU, each through the native kernels."""
    hf, config = tiny_moe_model(name)
    with torch.no_grad():
        # The parameters rounded to f16, not the RoPE buffers (hf.half() would round
        # inv_freq too, and move the reference's logits by 1e-3).
        for p in hf.parameters():
            p.copy_(p.half().float())
        expected = hf(IDS).logits
    state = {k: v.half() for k, v in hub_state_dict(hf, config["model_type"]).items()}
    loaded = load_model(save_hub_dir(tmp_path / "hub", config, state), CPU, "f32")
    with torch.no_grad():
        got = loaded.model(IDS, POSITIONS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
