"""Zyphra Zamba (v1) against transformers' ZambaForCausalLM, from a save_pretrained folder
(the shared block written once, at the first hybrid layer) and with the block repeated
under every hybrid layer, copies the loader drops. llama.cpp has no converter for Zamba:
folders only.

The tiny model: 4 layers (Mamba, hybrid, Mamba, hybrid), Mamba-1 in 2 heads of 64
features with a state of 16 and a time-step rank of 8, biased projections
(mamba_proj_bias).

Its features each move the logits by far more than the tolerance (planted below): the
attention's (head_dim / 2)^-0.5 scale, in_proj's interleaved input and gate rows (read
as halves instead).

Tolerances (the projections at half randomize()'s scale, as in test_zamba2.py; here
rounding moves the logits by 3e-4 at full scale): f32 logits 1e-4 max abs against
transformers: whole, through the cache (prefills in chunks, then one token at a time),
padded rows in scattered cache rows, serve's paged blocks with a state row; `llmrun run`
and serve's scheduler print transformers' greedy text.
"""

import pytest
import torch
from family_checks import PROMPT, check_run_and_show, check_whole_and_cached, max_diff
from family_checks import hf_model_of as hf_model_from
from helpers import BASE, cached_logits, our_model, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)
from safetensors.torch import load_file, save_file

from llmrun import api
from llmrun.loading import inspect, zamba2
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes
from llmrun.models.zamba import ModelArgs

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ZAMBA = dict(
    BASE,
    model_type="zamba",
    num_hidden_layers=4,
    layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
    num_key_value_heads=4,
    n_mamba_heads=2,
    mamba_d_state=16,
    mamba_dt_rank=8,
    mamba_proj_bias=True,
)
SCALES = dict.fromkeys(
    (
        "in_proj.weight", "q_proj.weight", "k_proj.weight",
        "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    ),
    0.5,
)  # fmt: skip
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf) -> torch.nn.Module:
    """llmrun's model of `hf` from its config and state dict (the shared block once)."""
    return our_model(hf.config.to_dict(), zamba2.hf_weights(hf.state_dict(), hf.config.to_dict()))


@pytest.fixture(scope="module")
def family():
    hf = hf_model_from(ZAMBA, SCALES)
    return hf, reference(hf)


def test_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits(family):
    hf, expected = family
    model = ours(hf)
    attention = model.model.layers[1].shared_transf.self_attn
    attention.scale = attention.head_dim**-0.5
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    model = ours(hf)
    for layer in model.model.layers:
        proj = getattr(layer, "mamba_decoder", layer).mamba.in_proj
        with torch.no_grad():
            proj.weight.copy_(torch.cat((proj.weight[0::2], proj.weight[1::2])))
            proj.bias.copy_(torch.cat((proj.bias[0::2], proj.bias[1::2])))
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_the_default_layer_pattern_is_zambaconfigs():
    config = {**ZAMBA, "layers_block_type": None, "num_hidden_layers": 20}
    kinds = transformers.ZambaConfig(**config).layers_block_type
    expected = ["hybrid" if kind == "hybrid" else "mamba" for kind in kinds]
    assert ModelArgs.from_config(config).layers_block_type == expected
    assert ModelArgs.from_config(config).attention_layers == [2, 7, 13, 19]


def test_padded_rows_paged_blocks_and_no_static_step(family):
    hf, expected = family
    model = ours(hf)
    check_padded_rows_in_scattered_slots(
        model, lambda ids: reference(hf, ids), IDS, padding_repeats=True
    )
    check_paged_with_a_state_row(
        model, IDS, expected, model.new_cache(3, 1, "f32", "cpu").recurrent
    )
    check_no_static_decode(model)


def test_run_show_and_serve_print_transformers_greedy_text(family, tmp_path):
    """From a folder with the shared block repeated at the second hybrid layer too."""
    hf, expected = family
    path = save_hf_dir(hf, tmp_path / "hf", tokenizer=True)
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.startswith("model.layers.1.shared_transf.")]:
        weights[name.replace("layers.1.", "layers.3.")] = weights[name].clone()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(path, CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_and_show(hf, path, "zamba")
    # Only the hybrid layers cache keys and values, heads of 2 * 64 / 4 (what show counts).
    per_position = 2 * 4 * 32 * 4 * 2
    assert kv_cache_bytes(hf.config.to_dict(), 10) == per_position * 10
    assert inspect.describe(path)["kv_cache_bytes_8k"] == per_position * 8192
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)
