"""Hunyuan V3 (hy_v3) against transformers' HYV3ForCausalLM: from config.json-style dicts
with the Hub's keys (mlp.router.gate, mlp.expert_bias, mlp.shared_mlp, one key per
expert), from a folder transformers saves (stacked experts) with an MTP layer past
num_hidden_layers, and from "hy_v3" GGUFs written as llama.cpp's converter writes them
(conversion/hunyuan.py HYV3Model: TextModel's keys, q/k rows as they are, the experts
stacked, the selection bias as exp_probs_b, the shared width, weights norm and scale,
sigmoid gating, and by default its MTP layer, counted in block_count).

Its features each move the logits by far more than the tolerance
(test_each_feature_changes_the_logits): the selection bias, router_scaling_factor, the
shared experts, mlp_layer_types, the q/k norms (by their weights) and attention_bias.

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
    check_run_and_show,
    check_show,
    load_matching_weights,
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, our_model, randomize
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
)
from test_cache_types import TOLERANCE
from test_glm4_moe import with_mtp_layer

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ARCH = "hy_v3"
COMMON = dict(
    model_type="hy_v3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=3,
    num_shared_experts=1,
    router_scaling_factor=2.5,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # Hy3's shape: the first layer dense, the rest experts, one shared expert.
    "default": {},
    # Layers typed out of order, two experts' width of shared experts, q/k/v/o biases.
    "layer-types": dict(
        mlp_layer_types=["sparse", "dense", "sparse"], num_shared_experts=2, attention_bias=True
    ),
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(name: str, **overrides):
    """A tiny transformers model of CONFIGS[name]: randomize()'s weights, attention
    outputs smaller (so that tokens do not look alike to the routers), and selection
    biases drawn large enough to change the choice."""
    config = transformers.AutoConfig.for_model(**{**COMMON, **CONFIGS[name], **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.03})
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "e_score_correction_bias"):
                layer.mlp.e_score_correction_bias.normal_(0, 0.3)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# transformers' names -> the Hub's (the reverse of conversion_mapping.py's hy_v3 renames).
HUB_NAMES = {
    ".mlp.gate.weight": ".mlp.router.gate.weight",
    ".mlp.e_score_correction_bias": ".mlp.expert_bias",
    ".mlp.shared_experts.": ".mlp.shared_mlp.",
}


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub's keys: its names for the router, the selection bias
    and the shared expert, one key per expert and projection."""
    out = {}
    for key, value in model.state_dict().items():
        head, sep, tail = key.partition(".mlp.experts.")
        if sep and tail == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.gate_proj.weight"] = value[e, :width]
                out[f"{head}.mlp.experts.{e}.up_proj.weight"] = value[e, width:]
            continue
        if sep:
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.down_proj.weight"] = value[e]
            continue
        for new, old in HUB_NAMES.items():
            key = key.replace(new, old)
        out[key] = value
    return out


def ours(hf):
    """llmrun's model of `hf`, loaded as a Hub folder is: its keys renamed at the loader
    edge (llmrun/loading/hy_v3.hf_weights)."""
    from llmrun.loading import hy_v3

    config = hf.config.to_dict()
    state = hy_v3.hf_weights(dict(hub_state_dict(hf)), config, lambda t: t)
    return our_model(config, state)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers_whole_and_through_the_cache(name):
    hf = hf_model(name)
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(whole, expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests above
# check every one of them.
FEATURES = {
    "selection bias": ("default", {}),  # the biases zeroed below
    "router_scaling_factor": ("default", {"router_scaling_factor": 1.0}),
    "shared experts": ("default", {}),  # their output zeroed below
    "mlp_layer_types": ("layer-types", {"mlp_layer_types": ["dense", "sparse", "sparse"]}),
    "q/k norms": ("default", {}),  # their weights set to 1 below
    "attention_bias": ("layer-types", {"attention_bias": False}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    name, change = FEATURES[feature]
    with_feature, without = hf_model(name), hf_model(name, **change)
    load_matching_weights(with_feature, without)
    with torch.no_grad():
        for layer in without.model.layers:
            if feature == "selection bias" and hasattr(layer.mlp, "e_score_correction_bias"):
                layer.mlp.e_score_correction_bias.zero_()
            if feature == "shared experts" and hasattr(layer.mlp, "shared_experts"):
                layer.mlp.shared_experts.down_proj.weight.zero_()
            if feature == "q/k norms":
                layer.self_attn.q_norm.weight.fill_(1.0)
                layer.self_attn.k_norm.weight.fill_(1.0)
    assert max_diff(reference(without), reference(with_feature)) > 0.1


def test_configs_llmrun_cannot_run_as_transformers_does_are_refused():
    from llmrun.models import hy_v3

    with pytest.raises(UnsupportedError, match="route_norm=false"):
        hy_v3.ModelArgs.from_config({**COMMON, "route_norm": False})
    with pytest.raises(ModelFormatError, match="mlp_layer_types"):
        hy_v3.ModelArgs.from_config({**COMMON, "mlp_layer_types": ["dense", "moe", "sparse"]})


def test_paged_cache_gives_the_contiguous_logits():
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py)."""
    hf = hf_model("default")
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values (what
    test_cache_types holds every family to). Only f16's drift from f32 is bounded: in
    bf16 or q8_0 a rounding can send a token to other experts."""
    f16 = cache_type == "f16"
    check_rounded_cache(
        ours(hf_model("default")), cache_type, TOLERANCE["f16"] if f16 else None, moves=f16
    )


def test_the_static_decode_step_is_not_offered():
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: Hunyuan V3 decodes through its forward."""
    from llmrun import static_decode

    model = ours(hf_model("default"))
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


def test_a_saved_folder_loads_without_its_multi_token_prediction_layer(tmp_path):
    """What transformers saves (its names, experts stacked or not), with an extra layer
    past num_hidden_layers as the Hub's checkpoints hold one: transformers ignores it,
    and so does llmrun."""
    from safetensors.torch import save_file

    hf = hf_model("layer-types")
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
    index = {"weight_map": {k: "model.safetensors" for k in hf.state_dict()}}
    index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(folder, CPU, "f32")
    assert loaded.model.decode_step is None  # not a family the native step knows
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


# ---- GGUF, as llama.cpp's converter writes "hy_v3" ----------------------------------------

LAYER_NAMES = MOE_LAYER_GGUF_NAMES


def hy_v3_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array, in llama.cpp's layout: rows as they are, experts stacked
    [E, out, in], the selection bias as blk.N.exp_probs_b (the Hub's mlp.expert_bias
    has no .bias suffix to keep)."""
    return fused_experts_gguf_tensors(
        model, LAYER_NAMES, {"mlp.e_score_correction_bias": "exp_probs_b"}
    )


def hy_v3_keys(config, mtp: bool) -> dict:
    """The "{arch}" keys llama.cpp's converter writes for the config."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers + (1 if mtp else 0),
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.EXPERT_SHARED_FEED_FORWARD_LENGTH: c.moe_intermediate_size * c.num_shared_experts,
        L.EXPERT_WEIGHTS_NORM: True,
        L.EXPERT_WEIGHTS_SCALE: float(c.router_scaling_factor),
        L.EXPERT_GATING_FUNC: 2,  # ExpertGatingFuncType.SIGMOID
    }
    if mtp:
        keys[L.NEXTN_PREDICT_LAYERS] = 1
    return keys


def write_hy_v3(path, model, qtype=None, mtp=True, metadata=None, tensors=None):
    """A hy_v3 GGUF of the model: its metadata as the converter writes it (with
    `metadata` changed; None leaves a key out), its tensors (or `tensors`), 2-D and 3-D
    ones but the router in `qtype` (default F32), stories260K's tokenizer."""
    keys = {**hy_v3_keys(model.config, mtp), **(metadata or {})}
    tensors = hy_v3_tensors(model) if tensors is None else tensors
    if mtp:
        tensors = with_mtp_layer(tensors, model.config.num_hidden_layers)
    return write_keyed_gguf(path, ARCH, keys, tensors, qtype)


@pytest.mark.parametrize("name,mtp", [("default", True), ("layer-types", True), ("default", False)])
def test_a_hy_v3_gguf_matches_transformers(tmp_path, name, mtp):
    hf = hf_model(name)
    loaded = load_model(write_hy_v3(tmp_path / "m.gguf", hf, mtp=mtp), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "hy_v3"
    assert config["num_hidden_layers"] == 3
    assert config["mlp_layer_types"] == hf.config.mlp_layer_types
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_the_optional_keys_reads_as_llama_cpp_does(tmp_path):
    """No gating key: sigmoid; no weights scale: none; no expert widths: the dense width
    over the experts used (here 96 / 3), the shared width the experts' (llama.cpp's
    defaults)."""
    hf = hf_model("default", router_scaling_factor=1.0)
    absent = {
        Keys.LLM.EXPERT_GATING_FUNC: None,
        Keys.LLM.EXPERT_WEIGHTS_SCALE: None,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: None,
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: None,
    }
    loaded = load_model(write_hy_v3(tmp_path / "m.gguf", hf, metadata=absent), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_selection_biases_runs_them_as_zero(tmp_path):
    """llama.cpp's exp_probs_b is optional: a layer without it chooses by the scores."""
    hf = hf_model("default")
    tensors = {k: v for k, v in hy_v3_tensors(hf).items() if "exp_probs_b" not in k}
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.e_score_correction_bias.zero_()
    loaded = load_model(write_hy_v3(tmp_path / "m.gguf", hf, tensors=tensors), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds each row's blocks, which
    are the rows of transformers' tensors)."""
    hf = hf_model("layer-types")
    path = write_hy_v3(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


REFUSED = {
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    "no weights norm": ({Keys.LLM.EXPERT_WEIGHTS_NORM: None}, UnsupportedError),
    "weights not renormalized": ({Keys.LLM.EXPERT_WEIGHTS_NORM: False}, UnsupportedError),
    "a shared width of 1.5 experts": (
        {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: 48},
        UnsupportedError,
    ),
    "partial RoPE": ({Keys.Rope.DIMENSION_COUNT: 16}, ModelFormatError),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError),
    "only MTP layers": ({Keys.LLM.NEXTN_PREDICT_LAYERS: 4}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_hy_v3(tmp_path / "m.gguf", hf_model("default"), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_describes_a_hy_v3_gguf(tmp_path):
    path = write_hy_v3(tmp_path / "m.gguf", hf_model("default"))
    # 3 layers (not the MTP one) of keys and values: 2 heads of 32, f32, 8192 positions.
    check_show(path, ARCH, 3 * 2 * 2 * 32 * 4 * 8192, moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model("default")
    check_run_and_show(hf, write_hy_v3(tmp_path / "m.gguf", hf), ARCH)
