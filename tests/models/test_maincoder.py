"""Maincoder (Maincode/Maincoder-1B) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py maincoder): a tiny
folder (MaincoderForCausalLM's config.json, Llama's keys with Qwen3's self_attn.q_norm and
k_norm, which llama.cpp's tensor map reads), converted by llama.cpp's converter
(conversion/maincoder.py: q/k rows as they are) to F32 and Q8_0 GGUFs. llmrun runs each
GGUF, and the folder itself, to llama.cpp's logits and greedy tokens: RoPE on adjacent
pairs, then the per-head q/k norms. The converter reads a BPE tokenizer.json by its
pre-tokenizer's hash, which stories260K's is not: CONVERTER_PATCH has it read the
SentencePiece tokenizer.model instead (the vocabulary alone; the model is the same).

Tolerances, measured: F32 GGUF and folder 6.2e-6 of llama.cpp's F32 logits (within about
±6.1), held to 1e-4; Q8_0 with llmrun's 8-bit activations (as llama.cpp multiplies) 1e-6,
held to 0.5 (tests/llama_cpp_golden.py TOLERANCES; exact activations 0.18). Whole
against cached decode: 1e-4. The norms' scale taken in the feature order RoPE left was
the bug the record caught first (1.0 off).
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

CONVERTER_PATCH = (
    "from conversion.maincoder import MaincoderModel\n"
    "MaincoderModel.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
)
CONFIG = {
    "architectures": ["MaincoderForCausalLM"],
    "model_type": "maincoder",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny Maincoder folder (see the module's note), weights from seed 0."""
    shapes = llama_shapes(64, 2, 4, 2, 96, 512)
    for i in range(2):
        for norm in ("q_norm", "k_norm"):
            shapes[f"model.layers.{i}.self_attn.{norm}.weight"] = (16,)
    write_folder(path, CONFIG, random_weights(shapes))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "maincoder", build_folder, CONVERTER_PATCH)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("maincoder"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "maincoder")
