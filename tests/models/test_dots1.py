"""dots.llm1 (dots1) against transformers' Dots1ForCausalLM: from config.json-style
dicts with the Hub's per-expert keys, from a folder transformers saves, and from "dots1"
GGUFs written as llama.cpp's converter writes them (conversion/dots1.py Dots1Model, a
Qwen2MoeModel: TextModel's keys, the q/k rows as they are, the experts stacked,
e_score_correction_bias as exp_probs_b.bias, the shared experts as ffn_*_shexp, the
leading dense layers, shared-expert count, weights scale and norm, and sigmoid gating
from the config's scoring_func).

Its features each move the logits by far more than the tolerance
(test_each_feature_changes_the_logits): the selection bias, the groups,
routed_scaling_factor, norm_topk_prob, first_k_dense_replace, the shared experts, the
q/k norms (by their weights). Their place before RoPE was checked by moving them after
it in llmrun's model: the parity tests then fail.

Tolerances: f32 logits (within about ±8) 1e-4 max abs against transformers, whole and
through the KV cache (chunked prefill, then one token at a time), contiguous or paged.
A Q8_0 GGUF: 1e-4 against transformers running the weights gguf dequantizes (the
router kept in F32, as the converter keeps it). Cache types: test_cache_types' checks.
"""

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
from gguf import ExpertGatingFuncType, GGMLQuantizationType, Keys
from helpers import cached_logits, our_model
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
)
from test_cache_types import TOLERANCE
from test_deepseek import hub_state_dict, routed_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ARCH = "dots1"
COMMON = dict(
    model_type="dots1",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,  # heads of 32, as the converter leaves head_dim out
    # As many KV heads as heads: llama.cpp's dots1 sizes k and v as the queries.
    num_key_value_heads=2,
    n_routed_experts=8,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # dots.llm1's shape: one group, two shared experts, renormalized and scaled weights.
    "inst": dict(n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    # Four groups of which a token reaches two, one shared expert, plain weights.
    "grouped": dict(n_shared_experts=1, n_group=4, topk_group=2),
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(name: str = "inst", **overrides):
    """A tiny transformers model of CONFIGS[name] (f32, eval; test_deepseek.routed_model's
    weights: selection biases drawn large enough to change the choice)."""
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
    """The released config.json: no layer_types, a null sliding_window, null groups,
    old-style rope_theta, scoring_func (which transformers does not read)."""
    hf = hf_model()
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    del config["layer_types"]
    config.update(
        sliding_window=None,
        max_window_layers=62,
        use_sliding_window=False,
        n_group=None,
        topk_group=None,
        rope_theta=1e6,
        rope_scaling=None,
        scoring_func="noaux_tc",
    )
    model = our_model(config, hub_state_dict(hf))
    assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests check it.
FEATURES = {
    "selection bias": ("inst", {}),  # the biases zeroed below
    "groups": ("grouped", {"n_group": 1, "topk_group": 1}),
    "routed_scaling_factor": ("inst", {"routed_scaling_factor": 1.0}),
    "norm_topk_prob": ("inst", {"norm_topk_prob": False}),
    "first_k_dense_replace": ("inst", {"first_k_dense_replace": 0}),
    "shared experts": ("inst", {}),  # their output zeroed below
    "q/k norms": ("inst", {}),  # their weights set to 1 below
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    name, change = FEATURES[feature]
    with_feature, without = hf_model(name), hf_model(name, **change)
    load_matching_weights(with_feature, without)
    with torch.no_grad():
        for layer in without.model.layers:
            if feature == "selection bias" and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
            if feature == "shared experts" and hasattr(layer.mlp, "shared_experts"):
                layer.mlp.shared_experts.down_proj.weight.zero_()
            if feature == "q/k norms":
                layer.self_attn.q_norm.weight.fill_(1.0)
                layer.self_attn.k_norm.weight.fill_(1.0)
    assert max_diff(reference(without), reference(with_feature)) > 0.1


def test_sliding_window_layers_are_refused():
    hf = hf_model()
    config = {**hf.config.to_dict(), "layer_types": None, "max_window_layers": 2}
    with pytest.raises(UnsupportedError, match="sliding-window layers"):
        our_model(config, hub_state_dict(hf))


def test_groups_of_one_expert_are_refused_without_naming_another_family():
    """dots.llm1 reads GLM-4.5 MoE's args, whose message named GLM-4.5."""
    hf = hf_model()
    config = {**hf.config.to_dict(), "n_group": hf.config.n_routed_experts, "topk_group": 1}
    with pytest.raises(UnsupportedError, match="groups of one expert") as refused:
        our_model(config, hub_state_dict(hf))
    assert "GLM" not in str(refused.value)


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
    back to the host: dots.llm1 decodes through its forward."""
    from llmrun import static_decode

    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


def test_a_saved_folder_loads_as_transformers_runs_it(tmp_path):
    hf = hf_model("grouped")
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


# ---- GGUF, as llama.cpp's converter writes "dots1" ---------------------------------------


def dots1_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: the rows as they are, the experts
    stacked, the selection bias as exp_probs_b.bias."""
    renamed = {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
    return fused_experts_gguf_tensors(model, MOE_LAYER_GGUF_NAMES, renamed)


def dots1_keys(config) -> dict:
    """The "{arch}" keys Dots1Model writes for the config: TextModel's (no key_length:
    the Hub's config has no head_dim; the groups where n_group is given; the gating
    from scoring_func "sigmoid"), Qwen2MoeModel's expert width, and its own."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    return {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.n_routed_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GROUP_COUNT: c.n_group,
        L.EXPERT_GROUP_USED_COUNT: c.topk_group,
        L.EXPERT_GATING_FUNC: int(ExpertGatingFuncType.SIGMOID),
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.LEADING_DENSE_BLOCK_COUNT: c.first_k_dense_replace,
        L.EXPERT_SHARED_COUNT: c.n_shared_experts,
        L.EXPERT_WEIGHTS_SCALE: float(c.routed_scaling_factor),
        L.EXPERT_WEIGHTS_NORM: bool(c.norm_topk_prob),
    }


def write_dots1_gguf(path, hf, qtype=None, metadata=None, tensors=None):
    """The model as llama.cpp's converter writes a "dots1" GGUF (its metadata with
    `metadata` changed, None leaving a key out; `tensors` in place of the model's),
    stories260K's tokenizer, every tensor of two or more dimensions but the router in
    `qtype` (default F32); returns `path`."""
    keys = {**dots1_keys(hf.config), **(metadata or {})}
    return write_keyed_gguf(path, ARCH, keys, tensors or dots1_tensors(hf), qtype)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_dots1_gguf_matches_transformers(tmp_path, name):
    hf = hf_model(name)
    loaded = load_model(write_dots1_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "dots1"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_is_not_attached(tmp_path):
    """The native step knows neither the sigmoid router nor its selection bias."""
    loaded = load_model(write_dots1_gguf(tmp_path / "m.gguf", hf_model()), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(loaded.model)


def test_a_gguf_without_the_optional_keys_reads_as_llama_cpp_does(tmp_path):
    """No weights norm or scale: neither applied; no groups: one (llama.cpp's defaults)."""
    hf = hf_model("inst", norm_topk_prob=False, routed_scaling_factor=1.0)
    absent = {
        Keys.LLM.EXPERT_WEIGHTS_NORM: None,
        Keys.LLM.EXPERT_WEIGHTS_SCALE: None,
        Keys.LLM.EXPERT_GROUP_COUNT: None,
        Keys.LLM.EXPERT_GROUP_USED_COUNT: None,
    }
    path = write_dots1_gguf(tmp_path / "m.gguf", hf, metadata=absent)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_selection_biases_runs_them_as_zero(tmp_path):
    """exp_probs_b is optional in llama.cpp: without it, no bias."""
    hf = hf_model()
    tensors = {k: v for k, v in dots1_tensors(hf).items() if "exp_probs_b" not in k}
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
    loaded = load_model(write_dots1_gguf(tmp_path / "m.gguf", hf, tensors=tensors), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in F32);
    the reference holds the same rounded values."""
    hf = hf_model("grouped")
    path = write_dots1_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


REFUSED = {
    "no gating key": ({Keys.LLM.EXPERT_GATING_FUNC: None}, UnsupportedError),
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    "partial RoPE": ({Keys.Rope.DIMENSION_COUNT: 16}, ModelFormatError),
    "no shared expert count": ({Keys.LLM.EXPERT_SHARED_COUNT: None}, ModelFormatError),
    "no expert width": ({Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: None}, ModelFormatError),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_dots1_gguf(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_describes_a_dots1_gguf(tmp_path):
    path = write_dots1_gguf(tmp_path / "m.gguf", hf_model())
    # 3 layers of keys and values: 2 KV heads of 32, f32, 8192 positions.
    check_show(path, ARCH, 3 * 2 * 2 * 32 * 4 * 8192, moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    path = write_dots1_gguf(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path)
