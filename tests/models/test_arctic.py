"""Snowflake Arctic against llama.cpp's recorded outputs (tests/llama_cpp_golden.py;
recorded by benchmarks/llama_cpp_golden.py arctic): a tiny folder as the Hub's holds it
(ArcticForCausalLM's config.json with parallel_attn_mlp_res and moe_layer_frequency 1;
Mixtral's keys plus residual_layernorm and residual_mlp.w1/w2/w3, the dense feed-forward
beside the experts), converted by llama.cpp's converter (conversion/arctic.py: q/k rows
permuted as Llama's) to F32 and Q8_0 GGUFs. llmrun runs each GGUF, and the folder itself,
to llama.cpp's logits and greedy tokens.

Tolerances, measured: F32 GGUF and folder 4.1e-6 of llama.cpp's F32 logits (within about
±6.2), held to 1e-4; the experts reading the input after attention instead of before
(a planted bug) moves them by 6.4. Q8_0 with llmrun's 8-bit activations 0.072, held to 0.5
(tests/llama_cpp_golden.py TOLERANCES). Whole against cached decode: 1e-4.
"""

import json
import shutil
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

HIDDEN, FFN, EXPERTS, VOCAB = 64, 48, 4, 512
CONFIG = {
    "architectures": ["ArcticForCausalLM"],
    "model_type": "arctic",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "moe_layer_frequency": 1,
    "parallel_attn_mlp_res": True,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny Arctic folder (see the module's note), weights from seed 0."""
    shapes = {}
    for name, shape in llama_shapes(HIDDEN, 2, 4, 2, FFN, VOCAB).items():
        if ".mlp." not in name:
            shapes[name] = shape
        if name.endswith("post_attention_layernorm.weight"):
            layer = name.rpartition(".post_attention_layernorm")[0]
            shapes[f"{layer}.residual_layernorm.weight"] = (HIDDEN,)
            shapes[f"{layer}.residual_mlp.w1.weight"] = (HIDDEN, HIDDEN)
            shapes[f"{layer}.residual_mlp.w3.weight"] = (HIDDEN, HIDDEN)
            shapes[f"{layer}.residual_mlp.w2.weight"] = (HIDDEN, HIDDEN)
            shapes[f"{layer}.block_sparse_moe.gate.weight"] = (EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                expert = f"{layer}.block_sparse_moe.experts.{e}"
                shapes[f"{expert}.w1.weight"] = (FFN, HIDDEN)
                shapes[f"{expert}.w3.weight"] = (FFN, HIDDEN)
                shapes[f"{expert}.w2.weight"] = (HIDDEN, FFN)
    write_folder(path, CONFIG, random_weights(shapes))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "arctic", build_folder)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("arctic"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "arctic")


@needs_converter
def test_a_layout_llama_cpp_does_not_run_is_one_error_line(files, tmp_path):
    from in_process import llmrun

    folder = tmp_path / "arctic"
    shutil.copytree(files["folder"], folder)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "moe_layer_frequency": 2}))
    result = llmrun("run", str(folder), "Once", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "moe_layer_frequency 2" in result.stderr
