"""Kolibri-1 (Aleph Alpha, llmrun/models/kolibri1.py) against transformers'
Kolibri1ForCausalLM, on one tiny random model: 4 layers (sliding-window layers with
RoPE, window 5, and a global one without), 8 experts (3 a token) and a shared expert of
its own width in every layer, selection biases drawn large enough to change the choice
(test_deepseek.routed_model). From config.json-style dicts with the Hub's per-expert
weights, from a folder transformers saves (stacked experts, num_local_experts) and from a
Hub-style folder (moe.router.expert_bias, post_attn_norm, post_ffn_norm, one tensor per
expert), which transformers' from_pretrained reads as the same model.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and serve's paged
blocks. `llmrun run` picks transformers' 8 greedy token ids from each folder.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    load_matching_weights,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, save_hf_dir
from safetensors.torch import save_file
from test_deepseek import hub_state_dict, routed_model

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import model_module

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kolibri1")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="kolibri1",
    num_hidden_layers=4,
    head_dim=16,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=3,
    sliding_window=5,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


@pytest.fixture(scope="module")
def hf():
    return routed_model(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


def test_matches_transformers_whole_cached_and_paged(hf, expected):
    assert 3 < expected.abs().max() < 10
    model = ours(hf)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    check_paged(model, IDS, expected)


def _variants(hf):
    """transformers models with `hf`'s weights but one feature changed."""

    def changed(**overrides):
        other = routed_model({**CONFIG, **overrides})
        load_matching_weights(hf, other)
        return other

    unbiased, unshared, renormalized = changed(), changed(), changed(norm_topk_prob=True)
    with torch.no_grad():
        for model, part in (
            (unbiased, "gate.e_score_correction_bias"),
            (unshared, "shared_experts"),
        ):
            for name, p in model.named_parameters():
                if part in name:
                    p.zero_()
            for name, b in model.named_buffers():
                if part in name:
                    b.zero_()
    all_sliding = changed(layer_types=["sliding_attention"] * 4)
    return {
        "selection bias": unbiased,
        "shared expert": unshared,
        "norm_topk_prob": renormalized,
        "global layer without RoPE": all_sliding,
    }


def test_each_feature_moves_the_logits_and_is_followed(hf, expected):
    for name, other in _variants(hf).items():
        moved = reference(other)
        assert max_diff(moved, expected) > 0.1, name
        assert max_diff(cached_logits(ours(other), IDS), moved) < 1e-4, name


HUB_NAMES = {
    "mlp.gate.e_score_correction_bias": "moe.router.expert_bias",
    "post_self_attn_layernorm": "post_attn_norm",
    "post_mlp_layernorm": "post_ffn_norm",
}


def save_hub_folder(hf, path):
    """The model as the Hub stores Kolibri-1: its selection bias and post-sublayer norms
    under the Hub's names, one tensor per expert; stories260K's tokenizer."""
    save_hf_dir(hf, path, tokenizer=True)
    (path / "model.safetensors").unlink()
    state = {}
    for key, value in hub_state_dict(hf).items():
        for new, old in HUB_NAMES.items():
            key = key.replace(new, old)
        state[key] = value.contiguous()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_the_folders_run_and_show(hf, expected, tmp_path):
    saved = save_hf_dir(hf, tmp_path / "saved", tokenizer=True)
    hub = save_hub_folder(hf, tmp_path / "hub")
    from_hub = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    assert max_diff(reference(from_hub.eval()), expected) == 0
    # 4 layers of 2 KV heads of 16, keys and values, f32: the global one 8192 positions,
    # the sliding ones their window of 5.
    kv_8k = 2 * 2 * 16 * 4 * (8192 + 3 * 5)
    for path in (saved, hub):
        loaded = load_model(path, CPU, "f32")
        assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
        check_run_token_ids(hf, path, tokens=8)
        check_show(path, "kolibri1", kv_8k, moe=True)


def test_refuses_a_config_without_a_window():
    """transformers' Kolibri1Model cannot build its masks without one either."""
    module = model_module("kolibri1")
    with pytest.raises(ModelFormatError, match="sliding_window"):
        module.ModelArgs.from_config({**CONFIG, "sliding_window": None})
