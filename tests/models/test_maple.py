"""Maple (deepgrove/maple-preview) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py maple): a tiny
folder as the Hub's holds it (MapleForCausalLM's config.json: layer_types with a sliding
window, nope_on_global_attention, partial_rotary_factor; Qwen3-MoE's keys), converted by
llama.cpp's converter (conversion/maple.py) to F32 and Q8_0 GGUFs. The window (4) is
shorter than the prompt, and the experts' gate and up weights are three times the others'
so that the SwiGLU clamp (7) bites. The converter reads a BPE tokenizer.json by its
pre-tokenizer's hash, which stories260K's is not: CONVERTER_PATCH has it read the
SentencePiece tokenizer.model instead.

Tolerances, measured: F32 GGUF and folder 1.2e-5 of llama.cpp's F32 logits (within about
±6.5), held to 1e-4; planted bugs move them by 1.8 (RoPE and the window on the global
layer too) to 8.6 (no window, no RoPE). Q8_0 with llmrun's 8-bit activations 1e-6, held
to 0.5 (tests/llama_cpp_golden.py TOLERANCES). Whole against cached decode (the sliding
layer's cache keeps only its window) and serve's paged blocks: 1e-4.
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

CONVERTER_PATCH = (
    "from conversion.maple import MapleModel\n"
    "MapleModel.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
)
HIDDEN, HEADS, KV_HEADS, HEAD, MOE_FFN, EXPERTS, VOCAB = 64, 4, 2, 16, 32, 4, 512
CONFIG = {
    "architectures": ["MapleForCausalLM"],
    "model_type": "maple",
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "moe_intermediate_size": MOE_FFN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD,
    "num_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "num_shared_experts": 0,
    "norm_topk_prob": True,
    "nope_on_global_attention": True,
    "partial_rotary_factor": 0.5,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny Maple folder (see the module's note), weights from seed 0."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(2):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (HIDDEN,)
        for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = (rows * HEAD, HIDDEN)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN, HEADS * HEAD)
        shapes[f"{layer}.self_attn.q_norm.weight"] = (HEAD,)
        shapes[f"{layer}.self_attn.k_norm.weight"] = (HEAD,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.mlp.gate.weight"] = (EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            expert = f"{layer}.mlp.experts.{e}"
            shapes[f"{expert}.gate_proj.weight"] = (MOE_FFN, HIDDEN)
            shapes[f"{expert}.up_proj.weight"] = (MOE_FFN, HIDDEN)
            shapes[f"{expert}.down_proj.weight"] = (HIDDEN, MOE_FFN)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    weights = random_weights(shapes)
    for name in weights:
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            weights[name] *= 3
    write_folder(path, CONFIG, weights)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "maple", build_folder, CONVERTER_PATCH)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("maple"), kind)


@needs_converter
def test_cached_decode_paged_blocks_run_and_show(files):
    check_decode_run_and_show(files, "maple")
    check_paged_blocks(files, "maple")
