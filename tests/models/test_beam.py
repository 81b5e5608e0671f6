"""Beam (llmrun/models/beam.py) against transformers' BeamForCausalLM, on one tiny random
model (4 layers: a dense one then experts, sliding layers with a window of 5 turning by
their own RoPE base, full layers without RoPE; hidden 64; 8 experts in 4 groups, 2 kept,
3 a token, random e_score_correction_bias; logits soft-capped at 5) and its
save_pretrained folder (one key per expert, as the Hub's). llama.cpp has no converter for
Beam: folders only.

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time; the sliding layers'
ring keeping only the window) and the paged cache (the sliding layers also in a pool of
their own, blocks let go as they leave the window), and whole at positions past 6000
(where the full layers' query scale is about 1.13). `llmrun run` picks transformers' 8
greedy token ids. Each Beam feature left out (the output gates, the query scale of the
layers without RoPE, the soft-cap) moves the logits by far more; the scaled residuals
cannot (see llmrun.models.beam.scaled_residual).
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, save_hf_dir
from moe_helpers import hub_state_dict
from test_deepseek import routed_model

from llmrun.loading.loader import load_model
from llmrun.models import beam, kv_cache_bytes

pytest.importorskip("transformers.models.beam")

CPU = torch.device("cpu")
KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CONFIG = dict(
    model_type="beam",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=5,
    layer_types=KINDS,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.0,
    final_logit_softcapping=5.0,
    max_position_embeddings=8192,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        "full_attention": None,
    },
    bos_token_id=1,
    eos_token_id=2,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
FAR = torch.arange(6000, 6040)[None]


@pytest.fixture(scope="module")
def hf():
    model = routed_model(CONFIG)
    with torch.no_grad():  # a buffer, which routed_model leaves at zero
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


def ours_of(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf, "qwen2_moe"))


def test_matches_transformers_whole_cached_paged_and_far(hf, expected, monkeypatch):
    ours = ours_of(hf)
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected, windowed="beam", monkeypatch=monkeypatch)
    with torch.no_grad():
        far = hf(IDS, position_ids=FAR).logits
        assert max_diff(far, expected) > 0.1  # the full layers' query scale at work
        assert max_diff(ours(IDS, FAR), far) < 1e-4


def test_the_folder_runs_and_shows(hf, expected, tmp_path):
    folder = save_hf_dir(hf, tmp_path / "Beam", tokenizer=True)
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # Two KV heads of 16, keys and values, f32: the full layers at 8192 positions, the
    # sliding ones their window of 5.
    per_position = 2 * 2 * 16 * 4
    check_show(folder, "beam", per_position * (2 * 8192 + 2 * 5), moe=True)
    assert kv_cache_bytes(hf.config.to_dict(), 8192) == per_position * (2 * 8192 + 2 * 5)


def without_gates(model, monkeypatch):
    for layer in model.model.layers:
        layer.self_attn.gate_proj.weight.data.zero_()
        layer.self_attn.gate_bias.data.fill_(100.0)  # sigmoid 1


def without_nope_scale(model, monkeypatch):
    monkeypatch.setattr(
        beam, "nope_query_scale", lambda p: torch.ones(p.shape[0], 1, p.shape[1], 1)
    )


def without_softcap(model, monkeypatch):
    model.args.final_logit_softcapping = None


@pytest.mark.parametrize("leave_out", [without_gates, without_nope_scale, without_softcap])
def test_each_feature_left_out_moves_the_logits(hf, leave_out, monkeypatch):
    model = ours_of(hf)
    leave_out(model, monkeypatch)
    with torch.no_grad():
        far = hf(IDS, position_ids=FAR).logits
        assert max_diff(model(IDS, FAR), far) > 0.1


def test_the_default_layer_types_are_transformers():
    from transformers import BeamConfig

    for layers in (1, 6, 13):
        assert beam.default_layer_types(layers) == BeamConfig(num_hidden_layers=layers).layer_types
