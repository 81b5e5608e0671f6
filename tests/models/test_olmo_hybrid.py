"""OLMo Hybrid (llmrun/models/olmo_hybrid.py) against transformers' OlmoHybridForCausalLM,
from its save_pretrained folder (stories260K's tokenizer): a tiny random model of four
layers, linear, full, linear, full, its linear layers two key heads serving four value
heads with betas in [0, 2] (linear_allow_neg_eigval), its attention layers two KV heads
for four turned by RoPE at a base of 50000; and the same without RoPE (rope_theta null,
the reference's NoPE) and with betas in [0, 1]. llama.cpp has no converter for the family.

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole,
through the KV cache and state (prefills in chunks, then one token at a time), from
serve's paged blocks with a state row, and rows of a batch padded on the right; `llmrun
run` picks transformers' 8 greedy token ids, and serve's scheduler (four prompts on three
state rows) its 12-token greedy text for each prompt.
"""

import shutil

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
from in_process import llmrun

from llmrun import api, ops
from llmrun.loading import olmo_hybrid as loading
from llmrun.loading.loader import Weight, load_model
from llmrun.models import olmo_hybrid

pytest.importorskip("transformers.models.olmo_hybrid")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="olmo_hybrid",
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
# Betas of sigmoid(b) alone: its decode steps may take the native Gated DeltaNet step.
NOPE = dict(
    CONFIG,
    rope_parameters=dict(rope_type="default", rope_theta=None),
    linear_allow_neg_eigval=False,
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def counted(function, calls: list):
    """`function`, appending its arguments to `calls` on each call."""

    def wrapper(*args):
        calls.append(args)
        return function(*args)

    return wrapper


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def ours(hf) -> olmo_hybrid.Model:
    """llmrun's model of `hf`, its weights renamed as the loader renames a folder's."""
    config = hf.config.to_dict()
    state = {k: Weight(v) for k, v in hf.state_dict().items()}
    weights = loading.hf_weights(state, "state", Weight)
    model = olmo_hybrid.Model(olmo_hybrid.ModelArgs.from_config(config))
    model.load_state_dict({k: w.tensor for k, w in weights.items()}, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hf_dir(hf, tmp_path_factory.mktemp("olmo_hybrid") / "Olmo-Hybrid", tokenizer=True)


def test_the_folder_matches_transformers_cached_paged_and_padded(hf, folder):
    expected = reference(hf)
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "olmo_hybrid"
    model = loaded.model
    assert [type(layer).__name__ for layer in model.model.layers] == [
        "LinearDecoderLayer", "DecoderLayer", "LinearDecoderLayer", "DecoderLayer",
    ]  # fmt: skip
    check_whole_and_cached(model, IDS, expected)
    check_paged_with_a_state_row(model, IDS, expected)
    check_padded_rows_decoded_together(model, lambda ids: reference(hf, ids), IDS)


def test_run_and_serve_give_transformers_greedy_tokens_and_show_names_it(hf, folder):
    check_run_token_ids(hf, folder, tokens=8, text=False)
    engine = api.load(str(folder), "cpu", ctx_size=128)
    check_no_static_decode(engine.model)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "Sam"]
    check_served_greedy_text(engine, hf, folder, prompts, parallel=3)
    # Two attention layers' keys and values: 2 KV heads of 16, f32, 8192 positions.
    check_show(folder, "olmo_hybrid", 2 * 2 * 2 * 16 * 4 * 8192)


def test_without_rope_and_each_feature_matters(hf, monkeypatch):
    """A null rope_theta turns RoPE off (the reference's NoPE), and linear_allow_neg_eigval
    false leaves the betas in [0, 1], which the native decode step takes. Running the NoPE
    model with RoPE, or the module's model (betas in [0, 2]) with betas in [0, 1], moves
    the logits by far more than the tolerance."""
    nope = hf_model_of(NOPE)
    expected = reference(nope)
    model = ours(nope)
    assert not model.args.rotary
    native = []
    monkeypatch.setattr(ops, "gated_delta_step", counted(ops.gated_delta_step, native))
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    if ops.native_takes(torch.zeros(1)):
        assert native
    turned = ours(nope)
    for layer in turned.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.rotary = True
    assert max_diff(cached_logits(turned, IDS), expected) > 0.05
    single = ours(hf)
    for layer in single.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.beta_scale = 1.0
    assert max_diff(cached_logits(single, IDS), reference(hf)) > 0.05


def test_a_folder_missing_a_projection_is_refused(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(folder, tmp_path / "broken")
    state = load_file(broken / "model.safetensors")
    del state["model.layers.2.linear_attn.k_proj.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    result = llmrun("run", str(broken), "Hi", "-n", "1")
    assert result.returncode == 1
    assert result.stderr == (
        f"error: {broken}: model.layers.2.linear_attn.k_proj.weight is missing\n"
    )
