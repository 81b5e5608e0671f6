"""Hunyuan MoE (hunyuan_v1_moe, Hunyuan-A13B) against transformers'
HunYuanMoEV1ForCausalLM: from config.json-style dicts (transformers' and the Hub's,
whose moe_topk, moe_intermediate_size and num_shared_expert list one value per layer)
with the Hub's per-expert keys, from a folder transformers saves, and from
"hunyuan-moe" GGUFs written as llama.cpp's converter writes them (conversion/hunyuan.py
HunYuanMoEModel: TextModel's keys, q/k rows as they are, query_layernorm and
key_layernorm as attn_q_norm and attn_k_norm, mlp.gate.wg as ffn_gate_inp, the shared
expert as ffn_*_shexp with intermediate_size as expert_shared_feed_forward_length, the
experts stacked, NTK-alpha RoPE written as the stretched base with a 256K context, no
output matrix when tied).

Its features each move the logits by far more than the tolerance
(test_each_feature_changes_the_logits): the shared expert, the number of experts a
token takes (moe_topk), NTK-alpha RoPE, the q/k norms' place after RoPE (by their
weights). The router's renormalization and the norms' place were each checked by
removing them from llmrun's model: the parity tests then fail.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole and
through the KV cache (chunked prefill, then one token at a time), contiguous or paged.
A Q8_0 GGUF: 1e-4 against transformers running the weights gguf dequantizes (the
router kept in F32, as the converter keeps it). Cache types: test_cache_types' checks.
"""

import json

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_prints_greedy_tokens,
    check_show,
    load_matching_weights,
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys, RopeScalingType
from helpers import cached_logits, our_model
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
)
from test_cache_types import TOLERANCE
from test_deepseek import hub_state_dict, routed_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ARCH = "hunyuan-moe"
ROUTER = "mlp.gate.wg.weight"
# A13B's RoPE: NTK-alpha 1000 on a base of 10000.
NTK_ALPHA = dict(rope_type="dynamic", rope_theta=10000.0, alpha=1000.0, factor=1.0)
COMMON = dict(
    model_type="hunyuan_v1_moe",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,  # hidden_size / heads, as the converter takes it for the RoPE base
    num_experts=8,
    moe_topk=3,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # A13B's shape: tied embeddings, NTK-alpha RoPE.
    "a13b": dict(tie_word_embeddings=True, rope_parameters=NTK_ALPHA),
    # Plain RoPE, an output matrix of its own, two experts a token.
    "plain": dict(moe_topk=2, rope_parameters=dict(rope_type="default", rope_theta=1e5)),
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
LONG_CONTEXT = 256 * 1024  # what the converter writes for NTK-alpha RoPE


def hf_model(name: str = "a13b", **overrides):
    """A tiny transformers model of CONFIGS[name] (f32, eval; test_deepseek.routed_model's
    weights: attention outputs small, so that tokens do not look alike to the router)."""
    return routed_model({**COMMON, **CONFIGS[name], **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers_whole_and_through_the_cache(name):
    hf = hf_model(name)
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_the_hubs_config_reads_as_transformers_reads_it():
    """A13B's config.json: per-layer lists, old-style rope_scaling {type: dynamic, alpha},
    the switches transformers ignores at the values it computes."""
    hf = hf_model()
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    layers = config["num_hidden_layers"]
    config.update(
        moe_topk=[3] * layers,
        moe_intermediate_size=[96] * layers,
        num_shared_expert=[1] * layers,
        use_qk_norm=True,
        use_mixed_mlp_moe=True,
        use_cla=False,
        rope_theta=10000.0,
        rope_scaling=dict(type="dynamic", alpha=1000.0, factor=1.0, beta_fast=32, beta_slow=1),
    )
    model = our_model(config, hub_state_dict(hf))
    assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests check it.
FEATURES = {
    "shared expert": {},  # its output zeroed below
    "moe_topk": {"moe_topk": 1},
    "NTK-alpha RoPE": {"rope_parameters": dict(rope_type="default", rope_theta=10000.0)},
    "q/k norms": {},  # their weights set to 1 below
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    with_feature, without = hf_model(), hf_model(**FEATURES[feature])
    load_matching_weights(with_feature, without)
    with torch.no_grad():
        for layer in without.model.layers:
            if feature == "shared expert":
                layer.mlp.shared_mlp.down_proj.weight.zero_()
            if feature == "q/k norms":
                layer.self_attn.query_layernorm.weight.fill_(1.0)
                layer.self_attn.key_layernorm.weight.fill_(1.0)
    assert max_diff(reference(without), reference(with_feature)) > 0.1


@pytest.mark.parametrize(
    "change,match",
    [
        ({"use_cla": True}, "use_cla=True"),
        ({"use_qk_norm": False}, "use_qk_norm=False"),
        ({"moe_topk": [3, 2]}, "moe_topk differs between layers"),
        ({"moe_topk": 9}, "moe_topk is 9, but there are 8 experts"),
    ],
)
def test_configs_llmrun_does_not_compute_are_refused(change, match):
    hf = hf_model()
    with pytest.raises((UnsupportedError, ModelFormatError), match=match):
        our_model({**hf.config.to_dict(), **change}, hub_state_dict(hf))


def test_paged_cache_gives_the_contiguous_logits():
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py)."""
    hf = hf_model()
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values (what
    test_cache_types holds every family to). Only f16's drift from f32 is bounded: in
    bf16 or q8_0 a rounding can send a token to other experts."""
    f16 = cache_type == "f16"
    check_rounded_cache(ours(hf_model()), cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_the_static_decode_step_is_not_offered():
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: Hunyuan MoE decodes through its forward."""
    from llmrun import static_decode

    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


def test_a_saved_folder_loads_as_transformers_runs_it(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_show_counts_a_folders_active_parameters_by_moe_topk(tmp_path):
    """llmrun show: a token's parameters, its moe_topk experts' of all, one per layer in
    the Hub's config as in transformers'."""
    hf_model().save_pretrained(tmp_path / "hf")
    info = inspect.describe(tmp_path / "hf")
    assert 0 < info["active_parameters"] < info["parameters"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["moe_topk"] = [config["moe_topk"]] * config["num_hidden_layers"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert inspect.describe(tmp_path / "hf")["active_parameters"] == info["active_parameters"]


# ---- GGUF, as llama.cpp's converter writes "hunyuan-moe" ---------------------------------

LAYER_NAMES = {
    **MOE_LAYER_GGUF_NAMES,
    "self_attn.query_layernorm": "attn_q_norm",
    "self_attn.key_layernorm": "attn_k_norm",
    "mlp.gate.wg": "ffn_gate_inp",
    "mlp.shared_mlp.gate_proj": "ffn_gate_shexp",
    "mlp.shared_mlp.up_proj": "ffn_up_shexp",
    "mlp.shared_mlp.down_proj": "ffn_down_shexp",
}


def hunyuan_moe_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: the rows as they are, the experts
    stacked, no output matrix where the embeddings are tied."""
    tensors = fused_experts_gguf_tensors(model, LAYER_NAMES, {})
    if model.config.tie_word_embeddings:
        del tensors["output.weight"]
    return tensors


def hunyuan_moe_keys(config) -> dict:
    """The "{arch}" keys HunYuanMoEModel writes for the config (TextModel's, then its
    own: the experts' widths and counts, NTK-alpha RoPE as the base it stretches to
    with the head size taken as hidden_size / heads, and a 256K context)."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    rope = c.rope_parameters
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(rope["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_experts,
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.EXPERT_SHARED_FEED_FORWARD_LENGTH: c.intermediate_size,
        # The Hub's moe_intermediate_size[0]; transformers' experts are intermediate_size wide.
        L.EXPERT_FEED_FORWARD_LENGTH: c.intermediate_size,
        L.EXPERT_USED_COUNT: c.moe_topk,
        L.EXPERT_SHARED_COUNT: 1,
    }
    if rope["rope_type"] == "dynamic":
        dim = c.hidden_size // c.num_attention_heads
        keys.update(
            {
                R.FREQ_BASE: rope["rope_theta"] * rope["alpha"] ** (dim / (dim - 2)),
                R.SCALING_TYPE: RopeScalingType.NONE.value,
                R.SCALING_FACTOR: 1.0,
                R.SCALING_ORIG_CTX_LEN: LONG_CONTEXT,
                L.CONTEXT_LENGTH: LONG_CONTEXT,
            }
        )
    return keys


def write_hunyuan_v1_moe_gguf(path, hf, qtype=None, metadata=None):
    """The model as llama.cpp's converter writes a "hunyuan-moe" GGUF (its metadata with
    `metadata` changed, None leaving a key out), stories260K's tokenizer, every tensor
    of two or more dimensions but the router in `qtype` (default F32); returns `path`."""
    keys = {**hunyuan_moe_keys(hf.config), **(metadata or {})}
    return write_keyed_gguf(path, ARCH, keys, hunyuan_moe_tensors(hf), qtype)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_hunyuan_moe_gguf_matches_transformers(tmp_path, name):
    hf = hf_model(name)
    loaded = load_model(write_hunyuan_v1_moe_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "hunyuan_v1_moe"
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_is_not_attached(tmp_path):
    """The native step knows neither Hunyuan's q/k norms after RoPE nor its router."""
    loaded = load_model(write_hunyuan_v1_moe_gguf(tmp_path / "m.gguf", hf_model()), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(loaded.model)


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in F32);
    the reference holds the same rounded values."""
    hf = hf_model("plain")
    path = write_hunyuan_v1_moe_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf, ROUTER)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_the_shared_width_takes_the_feed_forward_length(tmp_path):
    """llama.cpp's default: the shared expert feed_forward_length wide."""
    hf = hf_model()
    absent = {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: None}
    loaded = load_model(
        write_hunyuan_v1_moe_gguf(tmp_path / "m.gguf", hf, metadata=absent), CPU, "f32"
    )
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


REFUSED = {
    "sigmoid gating": ({Keys.LLM.EXPERT_GATING_FUNC: 2}, UnsupportedError),
    "weights not renormalized": ({Keys.LLM.EXPERT_WEIGHTS_NORM: False}, UnsupportedError),
    "scaled weights": ({Keys.LLM.EXPERT_WEIGHTS_SCALE: 2.5}, UnsupportedError),
    "an alpha key": ({Keys.Rope.SCALING_ALPHA: 1000.0}, UnsupportedError),
    "partial RoPE": ({Keys.Rope.DIMENSION_COUNT: 16}, ModelFormatError),
    "M-RoPE sections": ({Keys.Rope.DIMENSION_SECTIONS: [8, 4, 4, 0]}, UnsupportedError),
    "no expert width": ({Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: None}, ModelFormatError),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_hunyuan_v1_moe_gguf(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_describes_a_hunyuan_moe_gguf(tmp_path):
    path = write_hunyuan_v1_moe_gguf(tmp_path / "m.gguf", hf_model())
    # 2 layers of keys and values: 1 KV head of 32, f32, 8192 positions.
    check_show(path, ARCH, 2 * 2 * 1 * 32 * 4 * 8192, moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    path = write_hunyuan_v1_moe_gguf(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path)
