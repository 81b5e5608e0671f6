"""Grok (xai-org's Grok-1 and Grok-2) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py grok): a tiny
folder as Grok-2's holds it (Grok1ForCausalLM's config.json; pre_attn_norm,
post_attn_norm, pre_moe_norm and post_moe_norm around attention and the experts,
block_sparse_moe.experts.N.w1/w2/w3 and a dense mlp beside them, residual_moe), converted
by llama.cpp's converter (conversion/grok.py) to F32 and Q8_0 GGUFs. Soft-caps and
multipliers are set away from Grok's (attention scores capped at 4, logits at 10) so that
each one shows in the logits. llmrun runs each GGUF, and the folder itself, to llama.cpp's
logits and greedy tokens.

Tolerances, measured: F32 GGUF and folder 6.8e-4 of llama.cpp's F32 logits (within about
±2.8), held to 2e-3: llama.cpp's CPU GELU reads an f16 table (ggml-cpu/vec.h
GGML_GELU_FP16) where llmrun computes the tanh form (with that table emulated: 3.3e-6).
Planted bugs move them by 0.06 (no final soft-cap) to 2.1 (no dense feed-forward). Q8_0
with llmrun's 8-bit activations 0.027, held to 0.5 (tests/llama_cpp_golden.py
TOLERANCES). Whole against cached decode: 1e-4.
"""

from pathlib import Path

import pytest
import torch
from helpers import needs_converter
from llama_cpp_golden import (
    check_against_record,
    check_decode_run_and_show,
    check_paged_blocks,
    converted_folder,
    load_record,
    random_weights,
    write_folder,
)

from llmrun.loading.loader import load_model

HIDDEN, HEADS, KV_HEADS, HEAD, FFN, MOE_FFN, EXPERTS, VOCAB = 64, 4, 2, 16, 96, 48, 4, 512
CONFIG = {
    "architectures": ["Grok1ForCausalLM"],
    "model_type": "grok-1",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "moe_intermediate_size": MOE_FFN,
    "residual_moe": True,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "embedding_multiplier_scale": 8.0,
    "output_multiplier_scale": 0.5,
    "attn_output_multiplier": 0.2,
    "attn_logit_softcapping": 4.0,
    "router_logit_softcapping": 30.0,
    "final_logit_softcapping": 10.0,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny Grok-2 folder (see the module's note), weights from seed 0."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(2):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.pre_attn_norm.weight"] = (HIDDEN,)
        for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = (rows * HEAD, HIDDEN)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN, HEADS * HEAD)
        shapes[f"{layer}.post_attn_norm.weight"] = (HIDDEN,)
        shapes[f"{layer}.pre_moe_norm.weight"] = (HIDDEN,)
        shapes[f"{layer}.block_sparse_moe.gate.weight"] = (EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            expert = f"{layer}.block_sparse_moe.experts.{e}"
            shapes[f"{expert}.w1.weight"] = (MOE_FFN, HIDDEN)
            shapes[f"{expert}.w3.weight"] = (MOE_FFN, HIDDEN)
            shapes[f"{expert}.w2.weight"] = (HIDDEN, MOE_FFN)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (FFN, HIDDEN)
        shapes[f"{layer}.mlp.up_proj.weight"] = (FFN, HIDDEN)
        shapes[f"{layer}.mlp.down_proj.weight"] = (HIDDEN, FFN)
        shapes[f"{layer}.post_moe_norm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    write_folder(path, CONFIG, random_weights(shapes))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "grok", build_folder)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("grok"), kind, 2e-3 if kind != "q8_0" else None)


@needs_converter
def test_cached_decode_paged_blocks_run_and_show(files):
    check_decode_run_and_show(files, "grok")
    check_paged_blocks(files, "grok")
