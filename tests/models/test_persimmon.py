"""Persimmon (adept/persimmon-8b-*: llmrun's GPT-NeoX model, sequential, with q/k
LayerNorms and a squared-ReLU feed-forward; llmrun/loading/persimmon.py renaming its
checkpoints) against transformers' PersimmonForCausalLM, from its Hub-style folder
(config.json with rope_theta and partial_rotary_factor at the top, as the Hub's have them)
and from a config.json and a state dict. llama.cpp has no converter for Persimmon:
folders only.

The tiny model: 2 layers, hidden 64, 4 heads of 16 (half of each rotated, base 25000), a
feed-forward of 96, stories260K's 512-token vocabulary for `llmrun run`. Its features
each move the logits by far more than the tolerance (test_each_feature_is_followed): the
q/k LayerNorms, the sequential residual, the squared ReLU, the partial rotation.

Tolerances: f32 logits 1e-4 max abs against transformers, whole, through the KV cache
(prefills in chunks, then one token at a time) and the paged cache; the static decode
step 1e-5 against the ordinary forward. `llmrun run` picks transformers' 8 greedy token
ids from the folder.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_static_decode,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, save_hf_dir

from llmrun.loading import persimmon
from llmrun.loading.loader import load_model
from llmrun.models import gpt_neox

pytest.importorskip("transformers.models.persimmon")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="persimmon",
    vocab_size=BASE["vocab_size"],
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=25000.0, partial_rotary_factor=0.5),
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


def ours(hf):
    return our_model(hf.config.to_dict(), persimmon.hf_weights(hf.state_dict()))


def test_the_hub_folder_matches_transformers_whole_cached_paged_and_static(
    hf, expected, tmp_path, monkeypatch
):
    folder = save_hf_dir(hf, tmp_path / "persimmon-tiny", tokenizer=True)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        rope_scaling=None,
    )
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "persimmon"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_static_decode(loaded.model, monkeypatch)
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 2 layers' keys and values of 4 heads of 16, f32, 8192 positions.
    check_show(folder, "persimmon", 2 * 2 * 64 * 4 * 8192)


def test_without_qk_layernorm_with_gelu_and_whole_heads_matches_transformers_too():
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0)
    hf = hf_model_of(dict(CONFIG, qk_layernorm=False, hidden_act="gelu", rope_parameters=rope))
    with torch.no_grad():
        check_whole_and_cached(ours(hf), IDS, hf(IDS).logits)


def no_qk_layernorm(model, monkeypatch):
    for layer in model.model.layers:
        monkeypatch.setattr(layer.attention, "qk_layernorm", False)


def parallel_residual(model, monkeypatch):
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "parallel", True)


def relu(model, monkeypatch):
    for layer in model.model.layers:
        monkeypatch.setattr(layer.mlp, "act", torch.relu)


def whole_heads(model, monkeypatch):
    args = gpt_neox.ModelArgs.from_config(
        dict(CONFIG, rope_parameters=dict(CONFIG["rope_parameters"], partial_rotary_factor=1.0))
    )
    rotary = gpt_neox.RotaryEmbedding(args.rope_parameters, 16, 256)
    monkeypatch.setattr(model.model, "rotary_emb", rotary)


@pytest.mark.parametrize("planted", [no_qk_layernorm, parallel_residual, relu, whole_heads])
def test_each_feature_is_followed(hf, expected, planted, monkeypatch):
    model = ours(hf)
    planted(model, monkeypatch)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_a_config_without_rope_settings_takes_persimmons_defaults():
    """PersimmonConfig's: half of each head rotated, base 10000, q/k LayerNorms, relu2."""
    from transformers import PersimmonConfig

    config = {k: v for k, v in CONFIG.items() if k != "rope_parameters"}
    args = gpt_neox.ModelArgs.from_config(config)
    reference = PersimmonConfig(**config).rope_parameters
    assert args.rope_parameters["partial_rotary_factor"] == reference["partial_rotary_factor"]
    assert args.rope_parameters["rope_theta"] == reference["rope_theta"]
    assert (args.qk_layernorm, args.hidden_act, args.use_parallel_residual) == (
        True,
        "relu2",
        False,
    )
