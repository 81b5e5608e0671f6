"""Zyphra Zamba2 against transformers' Zamba2ForCausalLM, from a save_pretrained folder
(each shared block written once, at its first hybrid layer) and from the Hub's layout
(the block repeated under every hybrid layer, copies the loader drops). llama.cpp has no
converter for Zamba2: folders only.

The tiny model: 5 layers (Mamba-2, hybrid, Mamba-2, hybrid, hybrid), two shared blocks
taken in turn (the third hybrid layer runs block 0 again, through its own adapters),
adapters on q, k, v and gate_up_proj, RoPE in the shared attention, biased projections
(add_bias_linear), 8 Mamba-2 heads of 16 in 2 groups of B/C with a state of 16.

Its features each move the logits by far more than the tolerance (planted below): the
attention's (head_dim / 2)^-0.5 scale, RoPE (use_mem_rope), a hybrid layer's own adapter.

Tolerances (the projections at half randomize()'s scale, SCALES): f32 logits 1e-4 max abs against transformers: whole, through the cache
(prefills in chunks, then one token at a time), padded rows in scattered cache rows,
serve's paged blocks with a state row; `llmrun run` and serve's scheduler print
transformers' greedy text.
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
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect, zamba2
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes
from llmrun.models.zamba2 import ModelArgs

pytest.importorskip("transformers")

CPU = torch.device("cpu")
KINDS = ["mamba", "hybrid", "mamba", "hybrid", "hybrid"]
ZAMBA2 = dict(
    BASE,
    model_type="zamba2",
    num_hidden_layers=len(KINDS),
    layers_block_type=KINDS,
    num_key_value_heads=4,  # the key and value adapters need every head
    num_mem_blocks=2,
    use_shared_attention_adapter=True,
    adapter_rank=8,
    use_mem_rope=True,
    rope_theta=10000.0,
    add_bias_linear=True,
    n_mamba_heads=8,
    mamba_ngroups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    chunk_size=8,
)
# Projections at half randomize()'s scale: at full scale transformers' logits move by
# 1e-3 between two chunk sizes of its own scan (rounding amplified), at half by 2e-5.
SCALES = dict.fromkeys(
    ("in_proj.weight", "q_proj.weight", "k_proj.weight", "gate_up_proj.weight", "down_proj.weight"),
    0.5,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf) -> torch.nn.Module:
    """llmrun's model of `hf` from its config and state dict (each shared block once)."""
    return our_model(hf.config.to_dict(), zamba2.hf_weights(hf.state_dict(), hf.config.to_dict()))


@pytest.fixture(scope="module")
def family():
    hf = hf_model_from(ZAMBA2, SCALES)
    return hf, reference(hf)


def test_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits(family):
    """The attention scored by head_dim^-0.5, without RoPE, or without the third hybrid
    layer's own adapters (block 0's slot 2): each is off by units."""
    hf, expected = family
    for plant in ("scale", "rope", "adapter"):
        model = ours(hf)
        attention = model.model.layers[1].shared_transformer.self_attn
        if plant == "scale":
            attention.scale = attention.head_dim**-0.5
        elif plant == "rope":
            attention.rope = False
        else:
            block = model.model.layers[1].shared_transformer
            adapters = (
                block.feed_forward.gate_up_proj_adapter_list[2],
                attention.linear_q_adapter_list[2],
                attention.linear_k_adapter_list[2],
                attention.linear_v_adapter_list[2],
            )
            with torch.no_grad():
                for adapter in adapters:
                    adapter[1].weight.zero_()
        assert max_diff(cached_logits(model, IDS), expected) > 0.1, plant


def test_the_config_is_read_as_zamba2config_reads_it():
    args = ModelArgs.from_config(ZAMBA2)
    assert (args.num_hidden_layers, args.attention_layers, args.head_dim) == (5, [1, 3, 4], 32)
    assert args.intermediate_size == 96 and args.mamba_shape().head_dim == 16
    legacy = ModelArgs.from_config({**ZAMBA2, "layers_block_type": None, "layer_types": KINDS})
    assert legacy.layers_block_type == KINDS
    with pytest.raises(UnsupportedError, match="'attention'"):
        ModelArgs.from_config({**ZAMBA2, "layers_block_type": ["mamba", "attention"]})
    with pytest.raises(ModelFormatError, match="adapters need"):
        ModelArgs.from_config({**ZAMBA2, "num_key_value_heads": 2})


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


def test_the_hubs_repeated_blocks_load_as_one(family, tmp_path):
    """The Hub's folders hold each shared block under every hybrid layer that runs it."""
    hf, expected = family
    folder = save_hf_dir(hf, tmp_path / "hf")
    weights = load_file(folder / "model.safetensors")
    for name in [n for n in weights if n.startswith("model.layers.1.shared_transformer.")]:
        weights[name.replace("layers.1.", "layers.4.")] = weights[name].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(folder, CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_run_show_and_serve_print_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    path = save_hf_dir(hf, tmp_path / "hf", tokenizer=True)
    check_run_and_show(hf, path, "zamba2")
    # Only the hybrid layers cache keys and values, heads of 2 * 64 / 4 (what show counts).
    per_position = 2 * 4 * 32 * 4 * 3
    assert kv_cache_bytes(hf.config.to_dict(), 10) == per_position * 10
    assert inspect.describe(path)["kv_cache_bytes_8k"] == per_position * 8192
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)
