"""Orion (OrionStarAI/Orion-14B) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py orion): a tiny
folder as the Hub's holds it (OrionForCausalLM's config.json and keys: LayerNorms with
biases, no projection biases), converted by llama.cpp's converter (conversion/orion.py)
to F32 and Q8_0 GGUFs. llmrun runs each GGUF, and the folder itself, to llama.cpp's logits
and greedy tokens.

Tolerances, measured: F32 GGUF and folder 5.5e-6 of llama.cpp's F32 logits (within about
±5.4), held to 1e-4; Q8_0 with llmrun's 8-bit activations (as llama.cpp multiplies)
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
    converted_folder,
    llama_shapes,
    load_record,
    random_weights,
    write_folder,
)

from llmrun.loading.loader import load_model

NORMS = ("input_layernorm", "post_attention_layernorm", "model.norm")
CONFIG = {
    "architectures": ["OrionForCausalLM"],
    "model_type": "orion",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "max_sequence_length": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny Orion folder (see the module's note), weights from seed 0."""
    shapes = llama_shapes(64, 2, 4, 2, 96, 512, biases=NORMS)
    write_folder(path, CONFIG, random_weights(shapes))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "orion", build_folder)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("orion"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "orion")
