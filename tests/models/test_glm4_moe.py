"""GLM-4.5 MoE (glm4_moe; GGUF arch glm4moe), Solar Open (solar_open; also glm4moe) and
GLM-4.7-Flash (glm4_moe_lite; GGUF arch deepseek2) against transformers'
Glm4MoeForCausalLM, SolarOpenForCausalLM and Glm4MoeLiteForCausalLM: from
config.json-style dicts with the Hub's per-expert weights, from Hub folders that hold
a multi-token-prediction layer past num_hidden_layers, and from GGUFs written as
llama.cpp's converter writes them (conversion/glm.py: Glm4MoeModel keeps the q/k rows,
names the norm before the feed-forward post_attention_norm, stacks the experts, writes
e_score_correction_bias as exp_probs_b.bias and the rotated width as
rope.dimension_count; Glm4MoeLiteModel is DeepSeek-V2's converter; both keep the MTP
layer by default, counted in block_count and named by nextn_predict_layers).

Tolerances: 1e-4 on logits within about ±7 in f32 (measured ~5e-6), whole, through the
KV cache (chunked prefill, then one token at a time) and the paged cache. A Q8_0 GGUF
is held to transformers running the dequantized weights at 1e-4. Cache types are held
to the f32 cache at test_cache_types' tolerances.
"""

import json

import numpy as np
import pytest
import test_paged
import torch
from family_checks import (
    check_rounded_cache,
    check_run_prints_greedy_tokens,
    check_served_as_alone,
    check_show,
    load_matching_weights,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, our_model
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
)
from test_cache_types import TOLERANCE
from test_deepseek import gguf_tensors, hub_state_dict, routed_model, write_deepseek2

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # GLM-4.5-Air's shape: q/k/v biases, no q/k norms, one group, renormalized weights.
    "air": dict(
        model_type="glm4_moe",
        num_key_value_heads=2,
        head_dim=32,
        attention_bias=True,
        routed_scaling_factor=1.0,
        partial_rotary_factor=0.5,
    ),
    # GLM-4.5 (355B): q/k norms; here also 4 groups, a scale and a RoPE of a quarter.
    "full": dict(
        model_type="glm4_moe",
        num_key_value_heads=1,
        head_dim=32,
        attention_bias=True,
        use_qk_norm=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25),
    ),
    # GLM-4.7-Flash's shape: MLA with q LoRA, one group, scaled and renormalized weights.
    "flash": dict(
        model_type="glm4_moe_lite",
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=48,
        routed_scaling_factor=1.8,
        n_group=1,
        topk_group=1,
    ),
    # transformers builds the layers mlp_layer_types names, whatever first_k_dense_replace says.
    "flash-layer-types": dict(
        model_type="glm4_moe_lite",
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "dense", "sparse"],
    ),
    # Solar Open: experts in every layer, RoPE on all of a head by default (a base of 1e6).
    # (The converter writes the rotated width as head_dim * partial_rotary_factor, 0.5
    # where the config has none: stated here so that it rotates what transformers does.)
    "solar": dict(
        model_type="solar_open",
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=1.0,
        first_k_dense_replace=None,  # not a Solar Open field
    ),
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(name: str, **overrides):
    """A tiny transformers model of CONFIGS[name] (test_deepseek.routed_model's weights:
    selection biases drawn large enough to change the choice)."""
    return routed_model({**COMMON, **CONFIGS[name], **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers_whole_and_through_the_cache(name):
    hf = hf_model(name)
    expected = reference(hf)
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    with torch.no_grad():
        whole = ours(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert (cached_logits(ours, IDS) - expected).abs().max() < 1e-4


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests above
# check every one of them.
FEATURES = {
    "selection bias": ("full", {}),  # the biases zeroed below
    "groups": ("full", {"n_group": 1, "topk_group": 1}),
    "routed_scaling_factor": ("full", {"routed_scaling_factor": 1.0}),
    "norm_topk_prob": ("air", {"norm_topk_prob": False}),
    "use_qk_norm": ("full", {"use_qk_norm": False}),
    "attention_bias": ("air", {"attention_bias": False}),
    "partial_rotary_factor": ("air", {"partial_rotary_factor": 1.0}),
    "first_k_dense_replace": ("air", {"first_k_dense_replace": 0}),
    "shared experts": ("air", {}),  # their output zeroed below
    "mlp_layer_types": ("flash", {"mlp_layer_types": ["dense", "dense", "sparse"]}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    name, change = FEATURES[feature]
    with_feature, without = hf_model(name), hf_model(name, **change)
    load_matching_weights(with_feature, without)
    if feature == "selection bias":
        for layer in without.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
    if feature == "shared experts":
        for layer in without.model.layers[1:]:
            layer.mlp.shared_experts.down_proj.weight.data.zero_()
    assert (reference(without) - reference(with_feature)).abs().max() > 0.1


def test_dense_layers_after_expert_layers_are_refused():
    from llmrun.models import model_module

    module = model_module("glm4_moe_lite")
    config = {**COMMON, **CONFIGS["flash"], "mlp_layer_types": ["sparse", "dense", "sparse"]}
    with pytest.raises(UnsupportedError, match="dense layers after expert layers"):
        module.ModelArgs.from_config(config)


@pytest.mark.parametrize("name", ["full", "flash"])
def test_paged_cache_gives_the_contiguous_logits(name):
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py)."""
    hf = hf_model(name)
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(ours, "f32")


def test_paged_rows_decoded_together_give_their_own_logits():
    hf = hf_model("full")
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(
        our_model(hf.config.to_dict(), hub_state_dict(hf))
    )


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values (what
    test_cache_types holds every family to). Only f16's drift from f32 is bounded: in
    bf16 or q8_0 a rounding can send a token to other experts."""
    hf = hf_model("full")
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    f16 = cache_type == "f16"
    check_rounded_cache(ours, cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_glm_4_7_flash_caches_one_latent_head(cache_type):
    """As llama.cpp caches GLM-4.7-Flash (deepseek2's MLA): per token and layer one head
    of kv_lora_rank + qk_rope_head_dim (64 + 32, where a key has 32 + 32 and a value
    48), exact through the cache, and in every cache type the logits of its rounded
    latents (test_cache_types' check). f16 moves the logits by up to ~5e-3 here, at
    test_cache_types' bound: 1e-2 is allowed."""
    hf = hf_model("flash", kv_lora_rank=64)
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    assert ours.new_cache(1, 10, torch.float32, "cpu").k.shape == (3, 1, 1, 10, 96)
    assert (cached_logits(ours, IDS) - reference(hf)).abs().max() < 1e-4
    check_rounded_cache(ours, cache_type, 1e-2 if cache_type == "f16" else None)


def test_the_static_decode_step_is_not_offered():
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: GLM-4.5 decodes through its forward."""
    from llmrun import static_decode

    hf = hf_model("air")
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    assert not static_decode.supported(ours, ours.new_cache(1, 64, torch.float32, "cpu"))


@pytest.mark.parametrize("name", ["air", "flash"])
def test_a_hub_folder_loads_without_its_multi_token_prediction_layer(tmp_path, name):
    """The Hub's checkpoints hold an extra layer (model.layers.N for N layers) that
    transformers ignores; so does llmrun."""
    from safetensors.torch import save_file

    hf = hf_model(name)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    extra = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.input_layernorm.weight": torch.ones(64),
    }
    save_file(extra, str(folder / "model-mtp.safetensors"))
    index = {"weight_map": {k: "model.safetensors" for k in hub_state_dict(hf)}}
    index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(folder, torch.device("cpu"), "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


# ---- GGUF, as llama.cpp's converter writes "glm4moe" ------------------------------------

LAYER_NAMES = {**MOE_LAYER_GGUF_NAMES, "post_attention_layernorm": "post_attention_norm"}


def glm4moe_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array, in llama.cpp's layout (conversion/glm.py Glm4MoeModel: the
    rows as they are, the experts stacked)."""
    return fused_experts_gguf_tensors(
        model, LAYER_NAMES, {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
    )


def with_mtp_layer(tensors: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """The tensors and an MTP layer after the last one, as the converter keeps it: a
    decoder layer (here the last one's weights, scrambled) and its nextn.* tensors."""
    out = dict(tensors)
    rng = np.random.default_rng(3)
    for name, data in tensors.items():
        prefix = f"blk.{layers - 1}."
        if name.startswith(prefix):
            scrambled = rng.standard_normal(data.shape).astype(np.float32)
            out[f"blk.{layers}.{name[len(prefix) :]}"] = scrambled
    hidden = tensors["output_norm.weight"].shape[0]
    out[f"blk.{layers}.nextn.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        out[f"blk.{layers}.nextn.{norm}.weight"] = np.ones(hidden, np.float32)
    return out


def glm4moe_keys(config, mtp: bool) -> dict:
    """The "{arch}" keys llama.cpp's converter writes for the config."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    rope = c.rope_parameters
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers + (1 if mtp else 0),
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        # Solar Open's config has neither: the converter leaves the keys out.
        L.FEED_FORWARD_LENGTH: getattr(c, "intermediate_size", None),
        L.LEADING_DENSE_BLOCK_COUNT: getattr(c, "first_k_dense_replace", None),
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(rope["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.n_routed_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GROUP_COUNT: c.n_group,
        L.EXPERT_GROUP_USED_COUNT: c.topk_group,
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        R.DIMENSION_COUNT: int(c.head_dim * rope.get("partial_rotary_factor", 0.5)),
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.EXPERT_SHARED_COUNT: c.n_shared_experts,
        L.EXPERT_GATING_FUNC: 2,  # ExpertGatingFuncType.SIGMOID
        L.EXPERT_WEIGHTS_SCALE: float(c.routed_scaling_factor),
        L.EXPERT_WEIGHTS_NORM: bool(c.norm_topk_prob),
    }
    if mtp:
        keys[L.NEXTN_PREDICT_LAYERS] = 1
    return keys


def write_glm4moe(path, model, tensors: dict, qtype=None, mtp=True, metadata=None):
    """A glm4moe GGUF of the model: its metadata as the converter writes it (with
    `metadata` changed; None leaves a key out), `tensors`, 2-D and 3-D ones but the
    router in `qtype` (default F32), stories260K's tokenizer."""
    keys = {**glm4moe_keys(model.config, mtp), **(metadata or {})}
    if mtp:
        tensors = with_mtp_layer(tensors, model.config.num_hidden_layers)
    return write_keyed_gguf(path, "glm4moe", keys, tensors, qtype)


@pytest.mark.parametrize(
    "name,mtp", [("air", True), ("full", True), ("air", False), ("solar", False)]
)
def test_a_glm4moe_gguf_matches_transformers(tmp_path, name, mtp):
    hf = hf_model(name)
    path = write_glm4moe(tmp_path / "m.gguf", hf, glm4moe_tensors(hf), mtp=mtp)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "glm4_moe"
    assert loaded.checkpoint.config["num_hidden_layers"] == 3
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_glm4moe_gguf_without_the_optional_keys_reads_as_llama_cpp_does(tmp_path):
    """No gating key: sigmoid; no rope.dimension_count: every feature rotated; no
    weights norm or scale: neither applied (llama.cpp's defaults)."""
    hf = hf_model("air", partial_rotary_factor=1.0, norm_topk_prob=False)
    absent = {
        Keys.LLM.EXPERT_GATING_FUNC: None,
        Keys.Rope.DIMENSION_COUNT: None,
        Keys.LLM.EXPERT_WEIGHTS_NORM: None,
        Keys.LLM.EXPERT_WEIGHTS_SCALE: None,
    }
    path = write_glm4moe(tmp_path / "m.gguf", hf, glm4moe_tensors(hf), metadata=absent)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds each row's blocks, which
    are the rows of transformers' tensors)."""
    hf = hf_model("full")
    path = write_glm4moe(tmp_path / "m.gguf", hf, glm4moe_tensors(hf), GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


REFUSED = {
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    # GLM-4.5V's text with M-RoPE sections is read (tests/models/test_vl_text.py), but
    # not where llama.cpp turns a text pair by the fourth section's position 0.
    "M-RoPE pairs by position 0": ({Keys.Rope.DIMENSION_SECTIONS: [1, 1, 1, 1]}, UnsupportedError),
    "no shared expert count": ({Keys.LLM.EXPERT_SHARED_COUNT: None}, ModelFormatError),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError),
    "only MTP layers": ({Keys.LLM.NEXTN_PREDICT_LAYERS: 4}, ModelFormatError),
    "an odd rotated width": ({Keys.Rope.DIMENSION_COUNT: 7}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    hf = hf_model("air")
    path = write_glm4moe(tmp_path / "m.gguf", hf, glm4moe_tensors(hf), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, torch.device("cpu"), "f32")


def test_a_file_of_the_mtp_layer_alone_is_refused(tmp_path):
    hf = hf_model("air")
    tensors = {
        k: v
        for k, v in glm4moe_tensors(hf).items()
        if not k.startswith(("blk.0.", "blk.1.", "blk.2."))
    }
    path = write_glm4moe(tmp_path / "m.gguf", hf, tensors)
    with pytest.raises(UnsupportedError, match="multi-token-prediction layers only"):
        load_model(path, torch.device("cpu"), "f32")


def test_show_describes_a_glm4moe_gguf(tmp_path):
    hf = hf_model("full")
    path = write_glm4moe(tmp_path / "m.gguf", hf, glm4moe_tensors(hf))
    # 3 layers (not the MTP one) of keys and values: 1 head of 32, f32, 8192 positions.
    check_show(path, "glm4moe", 3 * 2 * 1 * 32 * 4 * 8192, moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model("full")
    path = write_glm4moe(tmp_path / "m.gguf", hf, glm4moe_tensors(hf))
    check_run_prints_greedy_tokens(hf, path)


# ---- GLM-4.7-Flash as llama.cpp's converter writes it: "deepseek2" ----------------------


@pytest.mark.parametrize("mtp", [True, False])
def test_a_glm_4_7_flash_deepseek2_gguf_matches_transformers(tmp_path, mtp):
    """Glm4MoeLiteModel's file: DeepSeek-V2's layout (MQA head_count_kv 1, attn_k_b and
    attn_v_b), sigmoid gating (written from the config's scoring_func; without it
    llama.cpp knows GLM-4.7-Flash by its 47 layers and vocabulary), and by default its
    MTP layer, counted in block_count."""
    hf = hf_model("flash")
    tensors = gguf_tensors(hf, split_kv=True)
    metadata = {Keys.LLM.EXPERT_GATING_FUNC: 2}
    if mtp:
        tensors = with_mtp_layer(tensors, hf.config.num_hidden_layers)
        metadata.update({Keys.LLM.BLOCK_COUNT: 4, Keys.LLM.NEXTN_PREDICT_LAYERS: 1})
    path = write_deepseek2(tmp_path / "m.gguf", hf, tensors, metadata=metadata)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "deepseek_v3"
    assert loaded.checkpoint.config["num_hidden_layers"] == 3
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_serve_gives_concurrent_requests_their_text_alone(tmp_path):
    """serve's scheduler (paged KV blocks, rows prefilled and decoded together) on a
    Q8_0 glm4moe file: each request gets the text it gets alone."""
    from llmrun import api
    from llmrun.sampling import SamplingParams

    hf = hf_model("full")
    path = write_glm4moe(tmp_path / "m.gguf", hf, glm4moe_tensors(hf), GGMLQuantizationType.Q8_0)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (engine.tokenizer.encode(p), SamplingParams(seed=i, temperature=0.8))
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)
