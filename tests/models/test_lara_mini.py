"""Lara Mini (llmrun/models/lara_mini.py) against transformers' LaraMiniForCausalLM, from
its save_pretrained folder (the Hub's fused in_proj, out_norm and stacked experts;
stories260K's tokenizer): a tiny random model of five layers in LaraMiniConfig's pattern
(linear, sliding, linear, full, sliding), a window of 5 tokens, two key heads serving
four value heads, four experts (two a token) and a shared expert, tied embeddings.
llama.cpp has no converter for the family.

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole,
through the KV cache and state (prefills in chunks, then one token at a time), from
serve's paged blocks with a state row, and rows of a batch padded on the right; `llmrun
run` picks transformers' 8 greedy token ids, and serve's scheduler (four prompts on three
state rows) its 12-token greedy text for each prompt.
"""

import pytest
import torch
from family_checks import (
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import BASE, cached_logits, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import ModelFormatError
from llmrun.loading import lara_mini as loading
from llmrun.loading.loader import Weight, load_model

pytest.importorskip("transformers.models.lara_mini")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="lara_mini",
    num_hidden_layers=5,
    head_dim=16,
    sliding_window=5,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    tie_word_embeddings=True,
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hf_dir(hf, tmp_path_factory.mktemp("lara_mini") / "Lara-Mini", tokenizer=True)


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model(folder, CPU, "f32")


def test_the_folder_matches_transformers_cached_paged_and_padded(hf, loaded):
    assert loaded.checkpoint.config["model_type"] == "lara_mini"
    model, expected = loaded.model, reference(hf)
    check_whole_and_cached(model, IDS, expected)
    check_paged_with_a_state_row(model, IDS, expected)
    check_padded_rows_decoded_together(model, lambda ids: reference(hf, ids), IDS)


def test_run_and_serve_give_transformers_greedy_tokens_and_show_names_it(hf, folder):
    check_run_token_ids(hf, folder, tokens=8, text=False)
    engine = api.load(str(folder), "cpu", ctx_size=128)
    check_no_static_decode(engine.model)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "Sam"]
    check_served_greedy_text(engine, hf, folder, prompts, parallel=3)
    # Three attention layers' keys and values: 2 KV heads of 16, f32, 8192 positions.
    check_show(folder, "lara_mini", 3 * 2 * 2 * 16 * 4 * 8192, moe=True)


def test_each_feature_matters(hf, loaded, monkeypatch):
    """RoPE on the full layers too, no window on the sliding ones, or the top-k weights
    not renormalized each move the logits by far more than the tolerance."""
    model, expected = loaded.model, reference(hf)
    layers = model.model.layers
    assert not layers[3].self_attn.rotary and layers[4].self_attn.rotary
    monkeypatch.setattr(layers[3].self_attn, "rotary", True)
    assert max_diff(cached_logits(model, IDS), expected) > 0.05
    monkeypatch.undo()
    monkeypatch.setattr(model.args, "sliding_window", 1000)
    assert max_diff(cached_logits(model, IDS), expected) > 0.05
    monkeypatch.undo()
    for layer in layers:
        monkeypatch.setattr(layer.mlp, "norm_topk_prob", False)
    assert max_diff(cached_logits(model, IDS), expected) > 0.05
    monkeypatch.undo()
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_an_in_proj_of_the_wrong_size_is_refused(hf):
    weights = {k: Weight(v) for k, v in hf.state_dict().items()}
    weights["model.layers.0.linear_attn.in_proj.weight"] = Weight(torch.zeros(100, 64))
    with pytest.raises(ModelFormatError, match=r"^here: .*in_proj\.weight has shape \(100, 64\)"):
        loading.hf_weights(weights, hf.config.to_dict(), "here", Weight)
