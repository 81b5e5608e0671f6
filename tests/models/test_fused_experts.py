"""GGUFs whose experts llama.cpp's converter wrote fused (`--fuse-gate-up-exps`: one
ffn_gate_up_exps stack a layer, gate rows then up rows, which llama.cpp's loader takes for
Qwen3.5-MoE, Qwen3-Next and the DeepSeek-style families) load as transformers runs the
model: f32 logits within 1e-4, as the same files with separate stacks do. A Q8_0 file's
halves are views of its block rows, the same bytes as separate stacks hold."""

import gguf
import numpy as np
import pytest
import test_mistral4
import test_qwen3_5
import torch
from family_checks import max_diff
from helpers import cached_logits, fuse_gate_up_experts
from test_deepseek import gguf_tensors, write_deepseek2
from test_qwen3_5 import IDS, hf_model, reference, write_qwen35_gguf
from test_qwen3_next import NEXT, converter_split

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model

pytest.importorskip("transformers")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen35_moe():
    hf = hf_model("moe")
    return hf, reference(hf)


def test_a_fused_qwen35_moe_gguf_matches_transformers(qwen35_moe, tmp_path):
    hf, expected = qwen35_moe
    path = write_qwen35_gguf(tmp_path / "m.gguf", hf, mtp=True, fuse_experts=True)
    names = [t.name for t in gguf.GGUFReader(path).tensors]
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_up_exps.weight" not in names
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_fused_q8_0_gguf_holds_the_separate_stacks_bytes(qwen35_moe, tmp_path):
    hf, _ = qwen35_moe
    q8 = gguf.GGMLQuantizationType.Q8_0
    fused = load_model(write_qwen35_gguf(tmp_path / "f.gguf", hf, q8, fuse_experts=True), CPU)
    apart = load_model(write_qwen35_gguf(tmp_path / "s.gguf", hf, q8), CPU)
    fused_weights, apart_weights = fused.checkpoint.weights, apart.checkpoint.weights
    assert fused_weights.keys() == apart_weights.keys()
    for name, weight in apart_weights.items():
        assert torch.equal(fused_weights[name].tensor, weight.tensor), name
    assert torch.equal(cached_logits(fused.model, IDS), cached_logits(apart.model, IDS))


def test_a_fused_qwen3_next_gguf_matches_transformers(tmp_path):
    hf = hf_model(None, **{**NEXT, "mlp_only_layers": []})
    path = write_qwen35_gguf(
        tmp_path / "m.gguf", hf, state=converter_split(hf), mtp=True, fuse_experts=True
    )
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_fused_mistral4_gguf_matches_transformers(tmp_path):
    hf = test_mistral4.hf_model(rope_parameters={**test_mistral4.ROPE, "llama_4_scaling_beta": 0.0})
    tensors = fuse_gate_up_experts(gguf_tensors(hf, split_kv=True))
    loaded = load_model(write_deepseek2(tmp_path / "m.gguf", hf, tensors, arch="mistral4"), CPU)
    got = cached_logits(loaded.model, test_mistral4.IDS)
    assert max_diff(got, test_mistral4.reference(hf)) < 1e-4


def test_a_fused_stack_of_an_odd_height_is_refused(qwen35_moe, tmp_path, monkeypatch):
    def one_row_more(tensors):
        fused = fuse_gate_up_experts(tensors)
        name = "blk.1.ffn_gate_up_exps.weight"
        fused[name] = np.concatenate([fused[name], fused[name][:, :1]], 1)
        return fused

    monkeypatch.setattr(test_qwen3_5, "fuse_gate_up_experts", one_row_more)
    path = write_qwen35_gguf(tmp_path / "m.gguf", qwen35_moe[0], fuse_experts=True)
    with pytest.raises(ModelFormatError, match=r"ffn_gate_up_exps.*2 \* width"):
        load_model(path, CPU)
