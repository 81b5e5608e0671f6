"""DiffLlama (llmrun/models/diffllama.py) against transformers' DiffLlamaForCausalLM, from
a config.json and a state dict and from the folder save_pretrained writes. llama.cpp has
no converter for it (nothing in its conversion/ names DiffLlama): folders only.

The tiny model: 3 layers (lambda_init differs per layer), hidden 64, 4 query heads and 2
KV heads of 16 (the values split into two halves of one KV head), biases on q/k/v/o,
a RoPE base of 50000, stories260K's 512-token vocabulary for `llmrun run`.

What differential attention adds each moves the logits by far more than the tolerance
(test_each_feature_changes_the_logits): the per-layer lambda_init, the learned lambdas,
the weightless RMS norm over each head pair's 2 x head_dim outputs.

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache;
the static decode step 1e-5 against the ordinary forward. `llmrun run` picks
transformers' 8 greedy token ids from the folder.
"""

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

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import diffllama

pytest.importorskip("transformers.models.diffllama")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="diffllama",
    num_hidden_layers=3,
    head_dim=16,
    attention_bias=True,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


@pytest.fixture(scope="module")
def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


def test_matches_transformers_whole_cached_paged_and_static(ours, expected, monkeypatch):
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected)
    check_static_decode(ours, monkeypatch)


def test_the_folder_runs_and_shows(hf, expected, tmp_path):
    folder = save_hf_dir(hf, tmp_path / "DiffLlama", tokenizer=True)
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "diffllama"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8)
    # 3 layers' keys and values of 2 heads of 16, f32, 8192 positions.
    check_show(folder, "diffllama", 3 * 2 * 2 * 16 * 4 * 8192)


def constant_lambda_init(model, monkeypatch):
    for layer in model.model.layers:
        layer.self_attn.lambda_init = model.model.layers[0].self_attn.lambda_init


def no_learned_lambdas(model, monkeypatch):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.lambda_q1.zero_()
            layer.self_attn.lambda_q2.zero_()


def norm_per_half(model, monkeypatch):
    """Each head_dim half of a pair's output normed alone (the weightless norm's calls
    alone: F is torch's, which ops.rms_norm calls with weights)."""
    rms_norm = torch.nn.functional.rms_norm

    def per_half(x, shape, weight=None, eps=None):
        if weight is not None:
            return rms_norm(x, shape, weight, eps)
        return rms_norm(x.unflatten(-1, (2, -1)), (shape[0] // 2,), eps=eps).flatten(-2)

    monkeypatch.setattr(diffllama.F, "rms_norm", per_half)


FEATURES = {
    "per-layer lambda_init": constant_lambda_init,
    "learned lambdas": no_learned_lambdas,
    "the norm over both halves": norm_per_half,
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(hf, expected, feature, monkeypatch):
    model = our_model(hf.config.to_dict(), hf.state_dict())
    FEATURES[feature](model, monkeypatch)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) > 0.1


def test_odd_kv_heads_are_refused():
    with pytest.raises(ModelFormatError, match="two halves"):
        diffllama.ModelArgs.from_config({**CONFIG, "num_key_value_heads": 1})
