"""EXAONE MoE (K-EXAONE) against transformers' ExaoneMoeForCausalLM: from config.json-style
dicts with the Hub's per-expert weights, from a folder transformers saves, from a
Hub-style folder (selection bias as mlp.e_score_correction_bias, mtp.* weights), and
from "exaone-moe" GGUFs written as llama.cpp's converter writes them
(conversion/exaone.py ExaoneMoEModel: Exaone4Model's keys, the window and its
per-layer flags, the experts' keys, nextn_predict_layers; input_layernorm as
attn_norm, post_attention_layernorm as ffn_norm, the router as ffn_gate_inp, the
experts stacked, the shared experts as *_shexp, the selection bias as
exp_probs_b.bias).

Each feature moves transformers' logits by far more than the tolerance
(test_each_feature_moves_the_logits), so the parity tests check each: the selection
bias, groups, routed_scaling_factor, norm_topk_prob, the shared experts, the dense
first layer, the sliding window, the global layers without RoPE, the q/k norms.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time) or serve's paged
blocks. A Q8_0 GGUF is held to transformers running the dequantized weights at 1e-4.
Cache types are held to an f32 cache holding the rounded values at 1e-5.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_and_show,
    check_show,
    load_matching_weights,
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import BASE, cached_logits, our_model
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
)
from safetensors.torch import save_file
from test_deepseek import hub_state_dict, routed_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
# Four layers: one dense, then experts with a shared expert; local layers (window 5)
# and global ones in turn (the global layers' missing RoPE shows more before the last).
CONFIG = dict(
    BASE,
    model_type="exaone_moe",
    num_hidden_layers=4,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=3,
    num_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    sliding_window=5,
    sliding_window_pattern=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers EXAONE MoE (test_deepseek.routed_model's weights: selection
    biases drawn large enough to change the choice)."""
    return routed_model({**CONFIG, **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf, **config):
    return our_model({**hf.config.to_dict(), **config}, hub_state_dict(hf))


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def test_matches_transformers_whole_and_through_the_cache(family):
    hf, expected = family
    model = ours(hf)
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_grouped_routing_matches_transformers():
    """Four groups of two experts, the best two groups chosen (transformers' router)."""
    hf = hf_model(n_group=4, topk_group=2)
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def _variants(hf):
    """Pairs of transformers models with `hf`'s weights that differ in one feature alone:
    the one with it, the one without it."""

    def copy(**overrides):
        other = hf_model(**overrides)
        load_matching_weights(hf, other)
        return other

    unbiased, unshared, unnormed = copy(), copy(), copy()
    with torch.no_grad():
        for layer in unbiased.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        for layer in unshared.model.layers[1:]:
            layer.mlp.shared_experts.down_proj.weight.zero_()
        for layer in unnormed.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    unwindowed = copy(sliding_window=64)  # wider than the sequence
    grouped = copy(n_group=4, topk_group=2)
    return {
        "selection bias": (hf, unbiased),
        "groups": (grouped, hf),
        "routed_scaling_factor": (hf, copy(routed_scaling_factor=1.0)),
        "norm_topk_prob": (hf, copy(norm_topk_prob=False)),
        "shared experts": (hf, unshared),
        "dense first layer": (hf, copy(first_k_dense_replace=0)),
        "q/k norm scales": (hf, unnormed),
        "window": (hf, unwindowed),
        "global layer without RoPE": (
            unwindowed,
            copy(sliding_window=64, layer_types=["sliding_attention"] * 4),
        ),
    }


def test_each_feature_moves_the_logits(family):
    """Each feature moves transformers' logits by far more than the tolerance, and
    llmrun follows the model without it."""
    hf, _ = family
    for name, (with_it, without_it) in _variants(hf).items():
        expected = reference(without_it)
        assert max_diff(reference(with_it), expected) > 0.1, name
        assert max_diff(cached_logits(ours(without_it), IDS), expected) < 1e-4, name


def test_a_folder_transformers_saves_loads_as_it_runs(family, tmp_path):
    """transformers 5 saves the experts stacked (gate_up_proj, down_proj)."""
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_hub_folder_loads_without_its_multi_token_prediction_weights(family, tmp_path):
    """The Hub's keys: one per expert, the selection bias beside the router, mtp.*."""
    hf, expected = family
    hf.save_pretrained(tmp_path / "hub")
    for file in (tmp_path / "hub").glob("*.safetensors"):
        file.unlink()
    state = {}
    for key, value in hub_state_dict(hf).items():
        state[key.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")] = (
            value.contiguous()
        )
    state["mtp.fc.weight"] = torch.zeros(64, 128)
    state["mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(state, tmp_path / "hub" / "model.safetensors")
    loaded = load_model(tmp_path / "hub", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks, the windowed layers also in a pool of their own."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected, windowed="exaone_moe", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    check_rounded_cache(ours(family[0]), cache_type)


def test_the_static_decode_step_is_not_offered(family):
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: EXAONE MoE decodes through its forward."""
    from llmrun import static_decode

    model = ours(family[0])
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


# ---- GGUF, as llama.cpp's converter writes "exaone-moe" --------------------------------

ARCH = "exaone-moe"
LAYER_NAMES = MOE_LAYER_GGUF_NAMES


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: rows as they are (NEOX RoPE), experts
    stacked [E, rows, cols], the selection bias as exp_probs_b.bias."""
    return fused_experts_gguf_tensors(
        model, LAYER_NAMES, {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
    )


def exaone_moe_keys(config, nextn: int = 0) -> dict:
    """The "{arch}" keys the converter writes for a transformers config: TextModel's
    (no gating function: the config has no scoring_func), Exaone4Model's (vocabulary
    size, the window, its per-layer flags) and ExaoneMoEModel's."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    return {
        L.BLOCK_COUNT: c.num_hidden_layers + nextn,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GROUP_COUNT: c.n_group,
        L.EXPERT_GROUP_USED_COUNT: c.topk_group,
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.VOCAB_SIZE: c.vocab_size,
        A.SLIDING_WINDOW: c.sliding_window,
        A.SLIDING_WINDOW_PATTERN: [t == "sliding_attention" for t in c.layer_types],
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.EXPERT_SHARED_COUNT: c.num_shared_experts,
        L.EXPERT_SHARED_FEED_FORWARD_LENGTH: c.moe_intermediate_size * c.num_shared_experts,
        L.EXPERT_WEIGHTS_SCALE: float(c.routed_scaling_factor),
        L.EXPERT_WEIGHTS_NORM: c.norm_topk_prob,
        L.LEADING_DENSE_BLOCK_COUNT: c.first_k_dense_replace,
        L.NEXTN_PREDICT_LAYERS: nextn,
        R.SCALING_TYPE: "none",
    }


def write_exaone_moe(path, model, qtype=None, metadata=None, tensors=None, nextn=0):
    """An exaone-moe GGUF of the model: the converter's metadata (with `metadata`
    changed; None leaves a key out), its tensors (and `tensors`), 2-D and 3-D ones but
    the router in `qtype` (default F32), stories260K's tokenizer."""
    keys = {**exaone_moe_keys(model.config, nextn), **(metadata or {})}
    return write_keyed_gguf(path, ARCH, keys, {**gguf_tensors(model), **(tensors or {})}, qtype)


def test_an_exaone_moe_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_exaone_moe(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "exaone_moe"
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_with_its_multi_token_prediction_layer_runs_the_trunk(family, tmp_path):
    """The converter keeps the MTP layer last in block_count (nextn_predict_layers 1),
    its per-layer flags only for the trunk; llama.cpp skips its tensors, and so does
    llmrun."""
    hf, expected = family
    extra = {
        "blk.4.attn_norm.weight": np.ones(64, np.float32),
        "blk.4.nextn.eh_proj.weight": np.zeros((64, 128), np.float32),
        "blk.4.ffn_gate.weight": np.zeros((96, 64), np.float32),
    }
    path = write_exaone_moe(tmp_path / "m.gguf", hf, tensors=extra, nextn=1)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["num_hidden_layers"] == 4
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds blocks of each row, the
    rows of transformers' tensors)."""
    hf = hf_model()
    path = write_exaone_moe(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_the_optional_keys_reads_as_llama_cpp_does(family, tmp_path):
    """llama.cpp's defaults: a window of 128 and every fourth layer global, the
    experts' weights unscaled and not renormalized, no dense layers, the shared
    expert as wide as an expert, no selection bias where exp_probs_b is absent."""
    hf, _ = family
    absent = {
        Keys.Attention.SLIDING_WINDOW: None,
        Keys.Attention.SLIDING_WINDOW_PATTERN: None,
        Keys.LLM.EXPERT_WEIGHTS_SCALE: None,
        Keys.LLM.EXPERT_WEIGHTS_NORM: None,
        Keys.LLM.EXPERT_SHARED_COUNT: None,
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: None,
    }
    path = write_exaone_moe(tmp_path / "m.gguf", hf, metadata=absent)
    config = load_model(path, CPU, "f32").checkpoint.config
    assert config["sliding_window"] == 128
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert (config["routed_scaling_factor"], config["norm_topk_prob"]) == (1.0, False)
    assert config["num_shared_experts"] == 1
    tensors = {k: v for k, v in gguf_tensors(hf).items() if "exp_probs_b" not in k}
    expected = hf_model(
        sliding_window=128,
        sliding_window_pattern=4,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
    )
    state = hf.state_dict()
    for layer in range(1, 4):
        state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].zero_()
    expected.load_state_dict(state)
    keys = {**exaone_moe_keys(hf.config), **absent, Keys.LLM.LEADING_DENSE_BLOCK_COUNT: 1}
    path = write_keyed_gguf(tmp_path / "bare.gguf", ARCH, keys, tensors)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(expected)) < 1e-4


REFUSED = {
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError, "sigmoid"),
    "groups llama.cpp ignores": (
        {Keys.LLM.EXPERT_GROUP_COUNT: 4, Keys.LLM.EXPERT_GROUP_USED_COUNT: 2},
        UnsupportedError,
        "ignores the groups",
    ),
    "partial RoPE": ({Keys.Rope.DIMENSION_COUNT: 8}, ModelFormatError, "whole heads"),
    "a shared width of a part of an expert": (
        {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: 48},
        UnsupportedError,
        "whole number of experts",
    ),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError, "experts"),
    "MTP layers alone": ({Keys.LLM.NEXTN_PREDICT_LAYERS: 4}, ModelFormatError, "no layers"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(family, tmp_path, case):
    metadata, error, message = REFUSED[case]
    path = write_exaone_moe(tmp_path / "m.gguf", family[0], metadata=metadata)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_show_describes_an_exaone_moe_gguf(family, tmp_path):
    """Two sliding layers of at most 5 positions and two global layers of all 8192, each
    with 2 KV heads of 16 features, keys and values, f32: 2*2*16*4 bytes a position."""
    path = write_exaone_moe(tmp_path / "m.gguf", family[0])
    check_show(path, ARCH, 256 * (2 * 8192 + 2 * 5), moe=True)
    assert kv_cache_bytes(family[0].config.to_dict(), 8192) == 256 * (2 * 8192 + 2 * 5)


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    check_run_and_show(hf, write_exaone_moe(tmp_path / "m.gguf", hf), ARCH)
