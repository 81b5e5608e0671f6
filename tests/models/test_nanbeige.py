"""Nanbeige 4.2 (a looped Llama) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py nanbeige): a tiny
folder as the Hub's holds it (NanbeigeForCausalLM's config.json: Llama's fields and
num_loops 2; Llama's keys), converted by llama.cpp's converter (conversion/nanbeige.py:
LlamaModel's, q/k rows permuted) to F32 and Q8_0 GGUFs. llmrun runs each GGUF, and the
folder itself, to llama.cpp's logits and greedy tokens: both layers run twice, the final
norm between the loops, each run with keys and values of its own.

Tolerances, measured: F32 GGUF and folder 2.5e-5 of llama.cpp's F32 logits (within about
±5.9), held to 1e-4; Q8_0 with llmrun's 8-bit activations (as llama.cpp multiplies) 0.18
(one activation rounding to the next step after the prompt's attention; decoded a token
at a time, 7e-7), held to 0.5 (tests/llama_cpp_golden.py TOLERANCES; exact activations
0.5, and other greedy tokens).
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
    llama_shapes,
    load_record,
    random_weights,
    write_folder,
)

from llmrun.loading import inspect
from llmrun.loading.loader import load_model

CONFIG = {
    "architectures": ["NanbeigeForCausalLM"],
    "model_type": "nanbeige",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "num_loops": 2,
    "skip_loop_final_norm": False,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny Nanbeige folder (see the module's note), weights from seed 0."""
    write_folder(path, CONFIG, random_weights(llama_shapes(64, 2, 4, 2, 96, 512)))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "nanbeige", build_folder)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("nanbeige"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "nanbeige")


@needs_converter
def test_paged_blocks_give_the_contiguous_logits(files):
    check_paged_blocks(files, "nanbeige")  # its KV cache's own layout: an entry per loop


@needs_converter
def test_show_counts_a_kv_cache_entry_per_layer_and_loop(files):
    # 2 loops x 2 layers x keys and values x 2 KV heads x 16 features x 8192 positions x 4 bytes
    expected = 2 * 2 * 2 * 2 * 16 * 8192 * 4
    for kind in ("f32", "folder"):
        assert inspect.describe(files[kind])["kv_cache_bytes_8k"] == expected
