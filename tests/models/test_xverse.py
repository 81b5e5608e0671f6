"""XVERSE (xverse/XVERSE-7B, 13B, 65B) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py xverse): a tiny
folder as the Hub's holds it (XverseForCausalLM's config.json, Llama's keys), converted by
llama.cpp's converter (conversion/xverse.py: the vocabulary from tokenizer.json, q/k rows
permuted for its pairwise RoPE) to F32 and Q8_0 GGUFs. llmrun runs each GGUF, and the
folder itself, to llama.cpp's logits and greedy tokens. 4 heads sharing 2 KV heads, as the
65B's 64 share 8: the converter groups the key rows it permutes by heads // KV heads (2).

Tolerances, measured: F32 GGUF and folder 7e-6 of llama.cpp's F32 logits (within about
±5.5), held to 1e-4; Q8_0 with llmrun's 8-bit activations (as llama.cpp multiplies)
7e-7, held to 0.5 (tests/llama_cpp_golden.py TOLERANCES; exact activations: 0.36).
Whole against cached decode: 1e-4.
"""

from pathlib import Path

import pytest
import torch
from helpers import needs_converter
from llama_cpp_golden import (
    check_against_record,
    check_decode_run_and_show,
    converted_folder,
    llama_shapes,
    load_record,
    random_weights,
    write_folder,
)

from llmrun.loading.loader import load_model

CONFIG = {
    "architectures": ["XverseForCausalLM"],
    "model_type": "xverse",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "max_tokenizer_truncation": 192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny XVERSE folder (see the module's note), weights from seed 0."""
    write_folder(path, CONFIG, random_weights(llama_shapes(64, 2, 4, 2, 96, 512)))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "xverse", build_folder)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("xverse"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "xverse")
