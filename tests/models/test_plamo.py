"""PLaMo-13B (llmrun/models/plamo.py, llmrun/loading/plamo.py) against llama.cpp's recorded
outputs (tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py plamo): a
tiny folder as the Hub's holds it (PlamoForCausalLM's keys, one norm a layer, 4 query
heads of 16 sharing 2 key/value heads, n_shared_head 2; stories260K's tokenizer),
converted by llama.cpp's converter (conversion/plamo.py) to F32 and Q8_0 GGUFs. llmrun
runs each GGUF, and the folder itself, to llama.cpp's logits and greedy tokens.

The converter is written for PLaMo-13B alone (its query and output shuffles assert 5120
wide, head_count_kv is 5); CONVERTER_PATCH makes both follow the config's heads, the same
reordering at this size.

Tolerances, measured: F32 GGUF and folder 3.4e-6 of llama.cpp's F32 logits (within about
±5), held to 1e-4; Q8_0 with llmrun's 8-bit activations 1e-6 (tests/llama_cpp_golden.py
TOLERANCES). Whole against cached decode: 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import needs_converter
from llama_cpp_golden import (
    check_against_record,
    check_decode_run_and_show,
    llama_shapes,
    load_record,
    random_weights,
    write_folder,
)
from plamo_helpers import converted

from llmrun.loading import inspect
from llmrun.loading.loader import load_model

CONFIG = {
    "architectures": ["PlamoForCausalLM"],
    "model_type": "plamo",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # as the Hub's says; the model's are n_shared_head's
    "n_shared_head": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}
CONVERTER_PATCH = """
import conversion.plamo as plamo

def _heads(self):
    heads, shared = self.hparams["num_attention_heads"], self.hparams["n_shared_head"]
    return shared, heads // shared, self.hparams["hidden_size"] // heads

def _q(self, w):
    shared, groups, dim = _heads(self)
    return w.reshape(shared, groups, dim, -1).permute(1, 0, 2, 3).reshape(w.shape)

def _o(self, w):
    shared, groups, dim = _heads(self)
    return w.reshape(w.shape[0], shared, groups, dim).permute(0, 2, 1, 3).reshape(w.shape)

_plamo_parameters = plamo.PlamoModel.set_gguf_parameters

def _groups(self):
    add = self.gguf_writer.add_head_count_kv
    self.gguf_writer.add_head_count_kv = lambda count: add(_heads(self)[1])
    try:
        _plamo_parameters(self)
    finally:
        del self.gguf_writer.add_head_count_kv

plamo.PlamoModel.shuffle_attn_q_weight = _q
plamo.PlamoModel.shuffle_attn_output_weight = _o
plamo.PlamoModel.set_gguf_parameters = _groups
"""


def build_folder(path: Path) -> None:
    """The tiny PLaMo-13B folder (see the module's note), weights from seed 5."""
    shapes = llama_shapes(64, 2, 4, 4, 96, 512)
    hub = {}
    for name, shape in shapes.items():
        if name.endswith("post_attention_layernorm.weight"):
            continue  # one norm a layer
        name = name.replace("input_layernorm", "norm").replace(
            "model.layers.", "model.layers.layers."
        )
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            shape = (2 * 16, 64)
        hub[name] = shape
    write_folder(path, CONFIG, random_weights(hub, seed=5))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted(tmp_path_factory, "plamo")


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("plamo"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "plamo")
    # `show`'s KV cache: 2 KV heads of 16 (not the folder's num_key_value_heads), 2 layers.
    for source in (files["f32"], files["folder"]):
        assert inspect.describe(source)["kv_cache_bytes_8k"] == 2 * 2 * 2 * 16 * 4 * 8192
