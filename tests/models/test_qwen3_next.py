"""Qwen3-Next against transformers' Qwen3NextForCausalLM, from a config.json folder (its
fused in_proj_qkvz and in_proj_ba split at loading) and from a "qwen3next" GGUF written as
llama.cpp's converter writes it (conversion/qwen.py Qwen3NextModel: in_proj_qkvz split into
attn_qkv and attn_gate, in_proj_ba kept as ssm_ba, the value heads left grouped, and
Qwen3.5's other conversions, tests/models/test_qwen3_5.py).

The tiny model: two key heads serving four value heads, a dense feed-forward in layer 1
(mlp_only_layers) beside the experts. Tolerances as test_qwen3_5.py's: f32 logits 1e-4
max abs against transformers, whole, through the cache and state, and from paged blocks;
a Q8_0 GGUF against an F32 one of its weights rounded through Q8_0, 1e-4.
"""

import gguf
import pytest
import torch
from family_checks import check_run_and_show, max_diff
from helpers import CHUNKS, cached_logits
from hybrid_checks import check_paged_with_a_state_row
from test_qwen3_5 import DENSE, IDS, SEQ, hf_model, reference, write_qwen35_gguf

from llmrun.errors import UnsupportedError
from llmrun.loading import qwen3_next as loading
from llmrun.loading.loader import load_model
from llmrun.models import qwen3_next

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
NEXT = dict(
    DENSE,
    model_type="qwen3_next",
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
)


def next_model():
    return hf_model(None, **NEXT)


def converter_split(hf) -> dict[str, torch.Tensor]:
    """The model's state as llama.cpp's converter sees it after Qwen3NextModel's
    modify_tensors: in_proj_qkvz as in_proj_qkv ([q..., k..., v...]) and in_proj_z,
    written here as the converter computes them (transposed, viewed per key head)."""
    c = hf.config
    kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
    per = c.linear_num_value_heads // c.linear_num_key_heads
    out = {}
    for key, value in hf.state_dict().items():
        if key.endswith("in_proj_qkvz.weight"):
            columns = value.t().contiguous().view(c.hidden_size, c.linear_num_key_heads, -1)
            q, k, v, z = torch.split(columns, [kd, kd, per * vd, per * vd], dim=-1)
            flat = [t.contiguous().view(c.hidden_size, -1) for t in (q, k, v, z)]
            base = key.removesuffix("in_proj_qkvz.weight")
            out[base + "in_proj_qkv.weight"] = torch.cat(flat[:3], dim=-1).t().contiguous()
            out[base + "in_proj_z.weight"] = flat[3].t().contiguous()
        else:
            out[key] = value
    return out


def ours(hf) -> torch.nn.Module:
    from test_qwen3_5 import hub_state

    state = {}
    for key, value in hub_state(hf).items():
        if key.endswith("in_proj_qkvz.weight"):
            qkv, z = loading.split_qkvz(value, hf.config.to_dict())
            base = key.removesuffix("in_proj_qkvz.weight")
            state[base + "in_proj_qkv.weight"], state[base + "in_proj_z.weight"] = qkv, z
        elif key.endswith("in_proj_ba.weight"):
            b, a = loading.split_ba(value, hf.config.to_dict())
            base = key.removesuffix("in_proj_ba.weight")
            state[base + "in_proj_b.weight"], state[base + "in_proj_a.weight"] = b, a
        else:
            state[key] = value
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_config(hf.config.to_dict()))
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def family():
    hf = next_model()
    return hf, reference(hf)


def test_whole_chunked_and_decoded_match_transformers(family):
    hf, expected = family
    model = ours(hf)
    assert isinstance(model.model.layers[1].mlp, qwen3_next.qwen2_moe.MLP)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS, CHUNKS), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS, (3,)), expected) < 1e-4


def test_unrenormalized_expert_weights_follow_the_config():
    """norm_topk_prob false (Qwen3.5-MoE's router has no such choice): the top-k weights
    as the softmax gives them."""
    hf = hf_model(None, **{**NEXT, "norm_topk_prob": False})
    expected = reference(hf)
    assert max_diff(expected, reference(next_model())) > 0.05
    assert max_diff(cached_logits(ours(hf), IDS), expected) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks(family):
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected, rows=2, row=1, blocks=(3, 11, 5))


def test_a_gguf_matches_transformers(tmp_path):
    """llama.cpp runs every Qwen3-Next layer with experts: a model without dense layers."""
    hf = hf_model(None, **{**NEXT, "mlp_only_layers": []})
    path = write_qwen35_gguf(tmp_path / "n.gguf", hf, state=converter_split(hf), mtp=True)
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "qwen3_next" and not config["tiled_value_heads"]
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4
    q8 = gguf.GGMLQuantizationType.Q8_0
    state = converter_split(hf)
    quantized = load_model(write_qwen35_gguf(tmp_path / "q.gguf", hf, q8, state=state), CPU, "f32")
    exact = load_model(
        write_qwen35_gguf(tmp_path / "r.gguf", hf, round_trip=q8, state=state), CPU, "f32"
    )
    assert max_diff(cached_logits(quantized.model, IDS), cached_logits(exact.model, IDS)) < 1e-4
    check_run_and_show(hf, path, "qwen3next")


def test_the_older_fused_ssm_in_is_refused(tmp_path):
    hf = hf_model(None, **{**NEXT, "mlp_only_layers": []})
    state = converter_split(hf)
    state["model.layers.0.linear_attn.in_proj_qkvz.weight"] = torch.zeros(128, 64)
    path = write_qwen35_gguf(tmp_path / "n.gguf", hf, state=state)
    with pytest.raises(UnsupportedError, match="ssm_in"):
        load_model(path, CPU, "f32")
