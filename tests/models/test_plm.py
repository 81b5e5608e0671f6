"""PLM (PLM-Team/PLM-1.8B) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py plm): a tiny
folder (PLMForCausalLM's config.json with DeepSeek-V2's MLA fields, DeepSeek-V2's keys:
q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; mlp.up_proj and down_proj; no
lm_head), converted by llama.cpp's converter (conversion/plm.py) to F32 and Q8_0 GGUFs.
llmrun runs each GGUF, and the folder itself, to llama.cpp's logits and greedy tokens. The
converter reads a BPE tokenizer.json by its pre-tokenizer's hash, which stories260K's is
not: CONVERTER_PATCH has it read the SentencePiece tokenizer.model instead.

Tolerances, measured: F32 GGUF and folder 6.9e-6 of llama.cpp's F32 logits (within about
±5.5), held to 1e-4; Q8_0 with llmrun's 8-bit activations 0.13 (llmrun takes kv_b_proj's
rows as floats into its cached-latent attention, where llama.cpp multiplies by it),
held to 0.5 (tests/llama_cpp_golden.py TOLERANCES; exact activations 0.17, and other
greedy tokens). Whole against cached decode: 1e-4.
"""

from pathlib import Path

import pytest
import torch
from helpers import needs_converter
from llama_cpp_golden import (
    check_against_record,
    check_decode_run_and_show,
    converted_folder,
    load_record,
    random_weights,
    write_folder,
)

from llmrun.loading.loader import load_model

CONVERTER_PATCH = (
    "from conversion.plm import PLMModel\n"
    "PLMModel.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
)
HIDDEN, HEADS, RANK, NOPE, ROPE, V, FFN, VOCAB = 64, 4, 32, 16, 8, 16, 96, 512
CONFIG = {
    "architectures": ["PLMForCausalLM"],
    "model_type": "plm",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "kv_lora_rank": RANK,
    "q_lora_rank": None,
    "qk_nope_head_dim": NOPE,
    "qk_rope_head_dim": ROPE,
    "v_head_dim": V,
    "hidden_act": "relu2",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 100000.0,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny PLM folder (see the module's note), weights from seed 0."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(2):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.self_attn.q_proj.weight"] = (HEADS * (NOPE + ROPE), HIDDEN)
        shapes[f"{layer}.self_attn.kv_a_proj_with_mqa.weight"] = (RANK + ROPE, HIDDEN)
        shapes[f"{layer}.self_attn.kv_a_layernorm.weight"] = (RANK,)
        shapes[f"{layer}.self_attn.kv_b_proj.weight"] = (HEADS * (NOPE + V), RANK)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN, HEADS * V)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.mlp.up_proj.weight"] = (FFN, HIDDEN)
        shapes[f"{layer}.mlp.down_proj.weight"] = (HIDDEN, FFN)
    shapes["model.norm.weight"] = (HIDDEN,)
    write_folder(path, CONFIG, random_weights(shapes))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "plm", build_folder, CONVERTER_PATCH)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("plm"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "plm")
