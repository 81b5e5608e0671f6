"""PLaMo 3 (llmrun/models/plamo3.py, llmrun/loading/plamo3.py) against llama.cpp's recorded
outputs (tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py plamo3): a
tiny folder as the Hub's holds it (Plamo3ForCausalLM's keys, a tokenizer.jsonl of PLaMo's
format, tied embeddings), converted by llama.cpp's converter (conversion/plamo.py) to F32
and Q8_0 GGUFs: a sliding-window layer (window 6, its own RoPE base) then a global one
(sliding_window_pattern 2), heads of 32 on a width of 64. llmrun runs each GGUF, and the
folder itself, to llama.cpp's logits and greedy tokens.

Tolerances, measured: F32 GGUF and folder 1.5e-5 of llama.cpp's F32 logits (within about
±11), held to 1e-4; Q8_0 with llmrun's 8-bit activations 1.9e-6 (tests/llama_cpp_golden.py
TOLERANCES). Whole against cached decode (the window's ring): 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import needs_converter
from llama_cpp_golden import (
    check_against_record,
    check_decode_run_and_show,
    load_record,
    random_weights,
)
from plamo_helpers import converted, write_plamo_tokenizer
from safetensors.numpy import save_file

from llmrun.loading import inspect
from llmrun.loading.loader import load_model

CONFIG = {
    "architectures": ["Plamo3ForCausalLM"],
    "model_type": "plamo3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 96,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_local_theta": 100.0,
    "window_size": 6,
    "sliding_window_pattern": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}


def _shapes() -> dict[str, tuple[int, ...]]:
    c = CONFIG
    hidden, head, ff = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.layers.{i}."
        shapes.update({
            p + "pre_mixer_norm.weight": (hidden,),
            p + "mixer.qkv_proj.weight": ((heads + 2 * kv) * head, hidden),
            p + "mixer.q_norm.weight": (head,),
            p + "mixer.k_norm.weight": (head,),
            p + "mixer.o_proj.weight": (hidden, heads * head),
            p + "post_mixer_norm.weight": (hidden,),
            p + "pre_mlp_norm.weight": (hidden,),
            p + "mlp.gate_up_proj.weight": (2 * ff, hidden),
            p + "mlp.down_proj.weight": (hidden, ff),
            p + "post_mlp_norm.weight": (hidden,),
        })  # fmt: skip
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def build_folder(path: Path) -> None:
    """The tiny PLaMo 3 folder (see the module's note), weights from seed 4."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(random_weights(_shapes(), seed=4), str(path / "model.safetensors"))
    write_plamo_tokenizer(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted(tmp_path_factory, "plamo3")


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("plamo3"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "plamo3")
    # `show`'s KV cache: 2 KV heads of 32, keys and values, f32; the sliding layer's window.
    for source in (files["f32"], files["folder"]):
        assert inspect.describe(source)["kv_cache_bytes_8k"] == 2 * 2 * 32 * 4 * (8192 + 6)
