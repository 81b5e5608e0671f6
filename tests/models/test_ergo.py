"""Ergo (llmrun/models/ergo.py, llmrun/loading/ergo.py) against transformers'
ErgoForCausalLM, on one tiny random model (4 layers: a dense one then experts; sliding
layers with a window of 5 turning by RoPE on adjacent pairs, full layers without RoPE,
their scores scaled by global_attention_scale 1.5; hidden 64; 8 experts, 3 a token, random
e_score_correction_bias, and a shared expert; random residual gates) and the folder
transformers saves of it, under the Hub's names (tok_embeddings, layers.N.attention.wqkv,
feed_forward.gate_kernel [in, out], experts stacked [E, in, out], ...). llama.cpp has no
converter for Ergo: folders only.

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time; the sliding layers'
ring keeping only the window) and the paged cache (the sliding layers also in a pool of
their own). `llmrun run` picks transformers' 8
greedy token ids. Each Ergo feature left out (the residual gates, the experts' norms, the
global attention scale, RoPE on adjacent pairs) moves the logits by far more.
"""

import copy
import shutil

import pytest
import torch
import transformers
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    max_diff,
)
from helpers import BASE, cached_logits, save_hf_dir
from safetensors.torch import load_file, save_file
from test_deepseek import routed_model

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import base, ergo, kv_cache_bytes

pytest.importorskip("transformers.models.ergo")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="ergo",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    first_dense_intermediate_size=96,
    num_dense_blocks=1,
    moe_intermediate_size=32,
    shared_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=3,
    moe_routed_scaling_factor=2.0,
    sliding_window=5,
    global_attention_every_n_layers=2,
    global_attention_scale=1.5,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


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


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hf_dir(hf, tmp_path_factory.mktemp("ergo") / "Ergo", tokenizer=True)


def ours_of(folder):
    return load_model(folder, CPU, "f32").model


def test_the_hub_named_folder_matches_transformers_whole_cached_and_paged(
    expected, folder, monkeypatch
):
    assert "layers.1.feed_forward.gate_kernel" in load_file(folder / "model.safetensors")
    ours = ours_of(folder)
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected, windowed="ergo", monkeypatch=monkeypatch)


def test_the_folder_runs_and_shows(hf, folder):
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # Two KV heads of 16, keys and values, f32: the full layers at 8192 positions, the
    # sliding ones their window of 5.
    per_position = 2 * 2 * 16 * 4
    check_show(folder, "ergo", per_position * (2 * 8192 + 2 * 5), moe=True)
    assert kv_cache_bytes(hf.config.to_dict(), 8192) == per_position * (2 * 8192 + 2 * 5)


def test_a_bf16_folder_matches_transformers_reading_it(hf, tmp_path):
    """Half-precision weights stay in blocks for the native kernels, but for the router's,
    which it reads in f32."""
    folder = save_hf_dir(copy.deepcopy(hf), tmp_path / "bf16", dtype=torch.bfloat16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference.eval()(IDS).logits
    assert max_diff(cached_logits(ours_of(folder), IDS), expected) < 1e-4


def without_residual_gates(model, monkeypatch):
    monkeypatch.setattr(ergo.ResidualGate, "forward", lambda self, out, residual: out + residual)


def without_expert_norms(model, monkeypatch):
    monkeypatch.setattr(ergo.Expert, "forward", ergo.MLP.forward)


def without_global_scale(model, monkeypatch):
    for layer in model.model.layers:
        layer.self_attn.scale = layer.self_attn.head_dim**-0.5


def with_rope_on_halves(model, monkeypatch):
    monkeypatch.setattr(ergo, "rotate_pairs", lambda x, frame: base.Frame.rotate(frame, x))


@pytest.mark.parametrize(
    "leave_out",
    [without_residual_gates, without_expert_norms, without_global_scale, with_rope_on_halves],
)
def test_each_feature_left_out_moves_the_logits(expected, folder, leave_out, monkeypatch):
    model = ours_of(folder)
    leave_out(model, monkeypatch)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) > 0.1


def test_a_folder_without_its_output_matrix_is_refused(folder, tmp_path):
    headless = shutil.copytree(folder, tmp_path / "Ergo")
    weights = load_file(headless / "model.safetensors")
    del weights["output.weight"]
    save_file(weights, str(headless / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="output matrix"):
        load_model(headless, CPU, "f32")


def test_the_default_layer_types_and_a_flat_rope_are_read_as_transformers_reads_them():
    from transformers import ErgoConfig

    config = {**CONFIG, "num_hidden_layers": 9}
    del config["model_type"]
    reference = ErgoConfig(**config)
    args = ergo.ModelArgs.from_config(config)
    assert args.layer_types == reference.layer_types
    # The flat rope_parameters are the sliding layers', as transformers nests them.
    assert args.rope_by_type == ergo.ModelArgs.from_config(reference.to_dict()).rope_by_type


def test_an_ergo_tokenizer_encodes_as_transformers(tmp_path):
    """ErgoTokenizer's tokenizer.json (BPE with byte fallback, spaces replaced by ▁, no
    prefix space) on a small vocabulary: llmrun's tokenizer gives its ids."""
    from transformers.models.ergo.tokenization_ergo import ErgoTokenizer

    from llmrun.tokenizer import load_tokenizer

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<ctrl100>"])}
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    merges = [("h", "e"), ("l", "l"), ("ll", "o"), ("he", "llo"), ("▁", "w"), ("o", "r")]
    merges += [("▁w", "or"), ("l", "d"), ("▁wor", "ld"), ("▁", "h")]
    for token in ["▁", "h", "e", "l", "o", "w", "r", "d", "!"] + [a + b for a, b in merges]:
        vocab.setdefault(token, len(vocab))
    ErgoTokenizer(vocab=vocab, merges=merges).save_pretrained(tmp_path)
    reference, ours = ErgoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)
    for text in ["hello world", " hello  world!", "héllo\nworld", "<ctrl100>hello"]:
        ids = reference.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
