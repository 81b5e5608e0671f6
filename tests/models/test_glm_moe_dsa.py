"""GLM-5 (llmrun/models/glm_moe_dsa.py) beyond what test_deepseek_v32.py checks for it
alongside DeepSeek-V3.2 (parity with transformers whole, through the KV cache, the paged
cache, cache types and GGUFs, its adjacent-pair indexer RoPE and shared indexer layer
each shown to matter, `llmrun run` and `show`): indexer_types derived from
config.json as transformers derives it, and a "glm-dsa" GGUF read with llama.cpp's
defaults where it leaves keys out (indexer types, expert gating). Tolerance: 1e-4 on
f32 logits, as there."""

import types

import pytest
import torch
from gguf import Keys
from helpers import cached_logits
from test_deepseek import IDS
from test_deepseek_v32 import hf_model, reference, write_dsa

from llmrun.loading import dsa
from llmrun.loading.loader import load_model
from llmrun.models import glm_moe_dsa

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm_moe_dsa")


def test_glm_indexer_types_come_as_transformers_derives_them():
    config = transformers.GlmMoeDsaConfig
    for kwargs in (
        dict(index_topk_freq=4, index_skip_topk_offset=3),
        dict(index_topk_freq=2),
        dict(index_topk_pattern="FFSFS"),
        dict(),
    ):
        hf = config(num_hidden_layers=5, **kwargs)
        args = glm_moe_dsa.ModelArgs.from_config({**hf.to_dict(), **kwargs})
        assert args.indexer_types == hf.indexer_types, kwargs


def test_a_glm_dsa_gguf_without_indexer_types_has_every_layer_full(tmp_path):
    """llama.cpp's default below a context of 1M (GLM-5, 5.1)."""
    hf = hf_model("glm_moe_dsa", indexer_types=["full"] * 3)
    path = write_dsa(tmp_path / "m.gguf", hf, metadata={dsa.INDEXER_TYPES: None})
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["indexer_types"] == ["full"] * 3
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_glm_5_2s_default_indexer_types_from_a_context_of_1m():
    header = types.SimpleNamespace(path="m.gguf", architecture=dsa.GLM_DSA, metadata={})
    config = {"num_hidden_layers": 80, "max_position_embeddings": dsa.GLM_5_2_CONTEXT}
    kinds = dsa._indexer_types(header, config)
    full = [i for i, kind in enumerate(kinds) if kind == "full"]
    assert full == [0, 1, 2, *range(6, 78, 4)]


def test_a_glm_dsa_gguf_without_its_gating_key_is_sigmoid_gated(tmp_path):
    hf = hf_model("glm_moe_dsa")
    path = write_dsa(tmp_path / "m.gguf", hf, metadata={Keys.LLM.EXPERT_GATING_FUNC: None})
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4
