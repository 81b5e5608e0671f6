"""OpenELM (apple/OpenELM-270M ... 3B) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py openelm): a tiny
folder as the Hub's holds it (OpenELMForCausalLM's config.json: per-layer query and KV
heads, feed-forward widths from ffn_multipliers; its keys: one qkv_proj, per-head q/k
RMSNorms, proj_1 holding gate and up, the output matrix the embedding), converted by
llama.cpp's converter (conversion/openelm.py) to F32 and Q8_0 GGUFs. llmrun runs each GGUF,
and the folder itself, to llama.cpp's logits and greedy tokens. Its two layers differ in
heads (2 sharing 1, 4 sharing 2) and widths (32, 96).

Tolerances, measured: F32 GGUF and folder 4.6e-6 of llama.cpp's F32 logits (within about
±5.5), held to 1e-4; Q8_0 with llmrun's 8-bit activations (as llama.cpp multiplies)
1e-6, held to 0.5 (tests/llama_cpp_golden.py TOLERANCES; exact activations: 0.14).
Whole against cached decode: 1e-4.
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

HIDDEN, HEAD, VOCAB = 64, 16, 512
QUERY_HEADS, KV_HEADS, WIDTHS = [2, 4], [1, 2], [32, 96]
CONFIG = {
    "architectures": ["OpenELMForCausalLM"],
    "model_type": "openelm",
    "model_dim": HIDDEN,
    "num_transformer_layers": 2,
    "head_dim": HEAD,
    "num_query_heads": QUERY_HEADS,
    "num_kv_heads": KV_HEADS,
    "num_gqa_groups": 2,
    "qkv_multipliers": [0.5, 1.0],
    "ffn_multipliers": [0.5, 1.5],  # widths 32 and 96 at a divisor of 32
    "ffn_dim_divisor": 32,
    "ffn_with_glu": True,
    "activation_fn_name": "swish",
    "normalization_layer_name": "rms_norm",
    "normalize_qk_projections": True,
    "share_input_output_layers": True,
    "rope_freq_constant": 10000,
    "rope_max_length": 512,
    "max_context_length": 256,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny OpenELM folder (see the module's note), weights from seed 0."""
    shapes = {"transformer.token_embeddings.weight": (VOCAB, HIDDEN)}
    for i, (heads, kv_heads, width) in enumerate(zip(QUERY_HEADS, KV_HEADS, WIDTHS, strict=True)):
        layer = f"transformer.layers.{i}"
        shapes[f"{layer}.attn_norm.weight"] = (HIDDEN,)
        shapes[f"{layer}.attn.qkv_proj.weight"] = ((heads + 2 * kv_heads) * HEAD, HIDDEN)
        shapes[f"{layer}.attn.q_norm.weight"] = shapes[f"{layer}.attn.k_norm.weight"] = (HEAD,)
        shapes[f"{layer}.attn.out_proj.weight"] = (HIDDEN, heads * HEAD)
        shapes[f"{layer}.ffn_norm.weight"] = (HIDDEN,)
        shapes[f"{layer}.ffn.proj_1.weight"] = (2 * width, HIDDEN)
        shapes[f"{layer}.ffn.proj_2.weight"] = (HIDDEN, width)
    shapes["transformer.norm.weight"] = (HIDDEN,)
    write_folder(path, CONFIG, random_weights(shapes))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "openelm", build_folder)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("openelm"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "openelm")


@needs_converter
def test_paged_blocks_give_the_contiguous_logits(files):
    check_paged_blocks(files, "openelm")  # its KV cache's own layout: heads per layer
