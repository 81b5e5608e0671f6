"""MiMo-V2-Flash against transformers' MiMoV2FlashForCausalLM: from config.json-style
dicts with the Hub's per-expert weights, from a folder transformers saves, from a
Hub-style folder (Xiaomi's config names, attention_sink_bias, a fused qkv_proj,
model.mtp.* layers), and from "mimo2" GGUFs written as llama.cpp's converter writes
them (conversion/mimo.py MimoV2Model: TextModel's keys, head_count_kv one per layer,
the window and its per-layer flags, value_length, rope.dimension_count, the value
scale, nextn_predict_layers with the MTP layers last; input_layernorm as attn_norm,
post_attention_layernorm as ffn_norm, the sinks as attn_sinks, the router as
ffn_gate_inp, the experts stacked, the selection bias as exp_probs_b.bias).

The model: four layers, a global one first (1 key/value head) and three sliding ones
(window 5, 2 key/value heads, attention sinks); queries and keys 24 wide, values 16,
RoPE on the first 8 features with a base per layer type; a dense first layer, then
8 experts (3 a token). Each feature moves transformers' logits by far more than the
tolerance (test_each_feature_moves_the_logits), so the parity tests check each.

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV
cache (prefills in chunks, then one token at a time) or serve's paged blocks. A Q8_0
GGUF is held to transformers running the dequantized weights at 1e-4. Cache types are
held to an f32 cache holding the rounded values at 1e-5.
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
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import BASE, cached_logits, our_model
from safetensors.torch import save_file
from test_deepseek import hub_state_dict, q8_0, routed_model

from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="mimo_v2_flash",
    num_hidden_layers=4,
    num_key_value_heads=1,
    head_dim=24,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    sliding_window=5,
    attention_value_scale=0.6,
    rope_parameters={
        "full_attention": dict(
            rope_type="default", rope_theta=50000.0, partial_rotary_factor=0.334
        ),
        "sliding_attention": dict(
            rope_type="default", rope_theta=10.0, partial_rotary_factor=0.334
        ),
    },
)
LAYER_TYPES = ["full_attention"] + ["sliding_attention"] * 3
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers MiMo-V2-Flash (test_deepseek.routed_model's weights: selection
    biases drawn large enough to change the choice; the sinks N(0, 0.2) as drawn, here
    raised by 1 so that they take a share of each softmax)."""
    model = routed_model({**CONFIG, **overrides})
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.add_(1.0)
    return model


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
    assert hf.config.layer_types == LAYER_TYPES
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_grouped_and_scaled_routing_matches_transformers():
    """Four groups of two experts, the best two chosen; the weights scaled by 2.5."""
    hf = hf_model(n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def _variants(hf):
    """Pairs of transformers models with `hf`'s weights that differ in one feature alone:
    the one with it, the one without it."""

    def copy(**overrides):
        other = hf_model(**overrides)
        target = other.state_dict()
        same = {
            k: v for k, v in hf.state_dict().items() if k in target and target[k].shape == v.shape
        }
        other.load_state_dict(same, strict=False)
        return other

    unbiased, sinkless = copy(), copy()
    with torch.no_grad():
        for layer in unbiased.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        for layer in sinkless.model.layers[1:]:
            layer.self_attn.sinks.fill_(-1e9)  # no share of any softmax
    rope = CONFIG["rope_parameters"]
    one_base = {**rope, "sliding_attention": rope["full_attention"]}
    whole_heads = {kind: {**params, "partial_rotary_factor": 1.0} for kind, params in rope.items()}
    return {
        "attention sinks": (hf, sinkless),
        "window": (hf, copy(sliding_window=64)),  # wider than the sequence
        "sliding layers' RoPE base": (hf, copy(rope_parameters=one_base)),
        "partial RoPE": (hf, copy(rope_parameters=whole_heads)),
        "value scale": (hf, copy(attention_value_scale=None)),
        "selection bias": (hf, unbiased),
        "norm_topk_prob": (hf, copy(norm_topk_prob=False)),
        "routed_scaling_factor": (copy(routed_scaling_factor=2.5), hf),
        "groups": (copy(n_group=4, topk_group=2), hf),
        "dense first layer": (hf, copy(mlp_layer_types=["sparse"] * 4)),
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


def hub_folder(hf, path, fused_qkv: bool):
    """A folder as Xiaomi publishes it (in bf16's stead f32): its config names, one key per
    expert, the sinks as attention_sink_bias, q/k/v fused where `fused_qkv`, and an MTP
    layer under model.mtp.*."""
    c = hf.config
    rope = c.rope_parameters
    config = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        **{k: v for k, v in BASE.items() if k != "rms_norm_eps"},
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "swa_num_key_value_heads": 2,
        "swa_num_attention_heads": 4,
        "head_dim": 24,
        "swa_head_dim": 24,
        "v_head_dim": 16,
        "swa_v_head_dim": 16,
        "hybrid_layer_pattern": [0, 1, 1, 1],
        "moe_layer_freq": [0, 1, 1, 1],
        "sliding_window": 5,
        "sliding_window_size": 4,  # transformers reads a window of 5 from it
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "rope_theta": rope["full_attention"]["rope_theta"],
        "swa_rope_theta": rope["sliding_attention"]["rope_theta"],
        "partial_rotary_factor": 0.334,
        "layernorm_epsilon": c.rms_norm_eps,
        "attention_value_scale": 0.6,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_shared_experts": None,
        "routed_scaling_factor": None,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    state = {}
    for key, value in hub_state_dict(hf).items():
        state[key.replace(".self_attn.sinks", ".self_attn.attention_sink_bias")] = value
    if fused_qkv:
        for layer in range(4):
            prefix = f"model.layers.{layer}.self_attn."
            parts = [state.pop(f"{prefix}{p}_proj.weight") for p in "qkv"]
            state[f"{prefix}qkv_proj.weight"] = torch.cat(parts)
    state["model.mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    state["model.mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(96, 64)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return path


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_a_hub_folder_loads_as_transformers_runs_it(family, tmp_path, fused_qkv):
    hf, expected = family
    loaded = load_model(hub_folder(hf, tmp_path / "hub", fused_qkv), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "mimo_v2_flash"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


HUB_REFUSED = {
    "shared experts": {"n_shared_experts": 1},
    "sinks in the global layers": {"add_full_attention_sink_bias": True},
    "sliding layers of as many key/value heads": {"swa_num_key_value_heads": 1},
    "FP8 weights": {"quantization_config": {"quant_method": "fp8"}},
}


@pytest.mark.parametrize("case", list(HUB_REFUSED))
def test_a_hub_folder_transformers_would_run_otherwise_is_refused(family, tmp_path, case):
    path = hub_folder(family[0], tmp_path / "hub", fused_qkv=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **HUB_REFUSED[case]}))
    with pytest.raises(UnsupportedError):
        load_model(path, CPU, "f32")


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks, the windowed layers also in a pool of their own."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected, windowed="mimo_v2_flash", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    check_rounded_cache(ours(family[0]), cache_type)


def test_the_static_decode_step_is_not_offered(family):
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: MiMo-V2-Flash decodes through its forward."""
    from llmrun import static_decode

    model = ours(family[0])
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


# ---- GGUF, as llama.cpp's converter writes "mimo2" -------------------------------------

ARCH = "mimo2"
VALUE_SCALE = "{arch}.attention.value_scale"  # LLM_KV_ATTENTION_VALUE_SCALE
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: rows as they are (NEOX RoPE), the sinks
    as attn_sinks, experts stacked [E, rows, cols], the selection bias as
    exp_probs_b.bias."""
    out = {}
    for key, value in model.state_dict().items():
        data = value.float().numpy()
        if key in GLOBAL_NAMES:
            out[GLOBAL_NAMES[key]] = data
            continue
        _, _, layer, rest = key.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if rest == "self_attn.sinks":
            out[f"blk.{layer}.attn_sinks.weight"] = data
        elif rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = data
        elif rest == "mlp.experts.gate_up_proj":
            width = data.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :width]
            out[f"blk.{layer}.ffn_up_exps.weight"] = data[:, width:]
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = data
        else:
            out[f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"] = data
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def mimo2_keys(config, nextn: int = 0) -> dict:
    """The "{arch}" keys the converter writes for a transformers config: TextModel's
    (the global layers' RoPE base, the sliding layers' as freq_base_swa, the experts'
    counts and groups, key length), MimoV2Model's (head_count_kv per layer and the window
    flags, the MTP layers' as sliding ones; value length, expert width, the rotated
    width, the value scale, nextn_predict_layers)."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    hybrid = [int(t == "sliding_attention") for t in c.layer_types] + [1] * nextn
    rope = c.rope_parameters
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers + nextn,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: [c.num_key_value_heads * (2 if s else 1) for s in hybrid],
        R.FREQ_BASE: float(rope["full_attention"]["rope_theta"]),
        R.FREQ_BASE_SWA: float(rope["sliding_attention"]["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.n_routed_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GROUP_COUNT: c.n_group,
        L.EXPERT_GROUP_USED_COUNT: c.topk_group,
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.v_head_dim,
        A.SLIDING_WINDOW: c.sliding_window,
        A.SLIDING_WINDOW_PATTERN: hybrid,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        R.DIMENSION_COUNT: int(c.head_dim * rope["full_attention"]["partial_rotary_factor"]),
        VALUE_SCALE: float(c.attention_value_scale),
    }
    if nextn:
        keys[L.NEXTN_PREDICT_LAYERS] = nextn
    return keys


def write_mimo2(path, model, qtype=None, metadata=None, tensors=None, nextn=0):
    """A mimo2 GGUF of the model: the converter's metadata (with `metadata` changed;
    None leaves a key out), its tensors (and `tensors`; None leaves one out), 2-D and 3-D
    ones but the router in `qtype` (default F32), stories260K's tokenizer."""
    keys = {**mimo2_keys(model.config, nextn), **(metadata or {})}
    named = {**gguf_tensors(model), **(tensors or {})}
    named = {k: v for k, v in named.items() if v is not None}
    return write_keyed_gguf(path, ARCH, keys, named, qtype)


def test_a_mimo2_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_mimo2(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "mimo_v2_flash"
    assert config["layer_types"] == LAYER_TYPES
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_with_its_multi_token_prediction_layer_runs_the_trunk(family, tmp_path):
    """The converter keeps the MTP layer last in block_count and in the per-layer arrays
    (nextn_predict_layers 1); llama.cpp skips its tensors, and so does llmrun."""
    hf, expected = family
    extra = {
        "blk.4.attn_norm.weight": np.ones(64, np.float32),
        "blk.4.attn_sinks.weight": np.zeros(4, np.float32),
        "blk.4.nextn.eh_proj.weight": np.zeros((64, 128), np.float32),
    }
    path = write_mimo2(tmp_path / "m.gguf", hf, tensors=extra, nextn=1)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["num_hidden_layers"] == 4
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_with_fused_qkv_matches_transformers(family, tmp_path):
    """MiMo-V2.5's files fuse q, k and v into attn_qkv (queries, keys, values)."""
    hf, expected = family
    tensors = gguf_tensors(hf)
    for layer in range(4):
        parts = [tensors.pop(f"blk.{layer}.attn_{p}.weight") for p in "qkv"]
        tensors[f"blk.{layer}.attn_qkv.weight"] = np.concatenate(parts)
    keys = mimo2_keys(hf.config)
    path = write_keyed_gguf(tmp_path / "m.gguf", ARCH, keys, tensors, GGMLQuantizationType.Q8_0)
    state = {}
    for key, value in hf.state_dict().items():
        data = value.numpy()
        if data.ndim > 1 and not key.endswith("mlp.gate.weight"):
            data = q8_0(data)
        state[key] = torch.from_numpy(np.ascontiguousarray(data))
    quantized = hf_model()
    quantized.load_state_dict(state)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(quantized)) < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds blocks of each row, the
    rows of transformers' tensors)."""
    hf = hf_model()
    path = write_mimo2(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    state = {}
    for key, value in hf.state_dict().items():
        data = value.numpy()
        if data.ndim > 1 and not key.endswith("mlp.gate.weight"):
            data = q8_0(data)
        state[key] = torch.from_numpy(np.ascontiguousarray(data))
    hf.load_state_dict(state)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_the_optional_keys_reads_as_llama_cpp_does(family, tmp_path):
    """llama.cpp's defaults: no value scale, the sliding layers' RoPE base 10000, no
    selection bias where exp_probs_b is absent."""
    hf, _ = family
    absent = {VALUE_SCALE: None, Keys.Rope.FREQ_BASE_SWA: None}
    tensors = {f"blk.{i}.exp_probs_b.bias": None for i in range(1, 4)}
    path = write_mimo2(tmp_path / "m.gguf", hf, metadata=absent, tensors=tensors)
    rope = CONFIG["rope_parameters"]
    local = {**rope["sliding_attention"], "rope_theta": 10000.0}
    expected = hf_model(
        attention_value_scale=None, rope_parameters={**rope, "sliding_attention": local}
    )
    state = hf.state_dict()
    for layer in range(1, 4):
        state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].zero_()
    expected.load_state_dict(state)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["attention_value_scale"] == 1.0
    assert max_diff(cached_logits(loaded.model, IDS), reference(expected)) < 1e-4


REFUSED = {
    "groups llama.cpp ignores": (
        {Keys.LLM.EXPERT_GROUP_COUNT: 4, Keys.LLM.EXPERT_GROUP_USED_COUNT: 2},
        {},
        "ignores the groups",
    ),
    "a sliding layer without sinks": ({}, {"blk.1.attn_sinks.weight": None}, "sinks"),
    "a global layer with sinks": (
        {},
        {"blk.0.attn_sinks.weight": np.zeros(4, np.float32)},
        "sinks",
    ),
    "sliding layers of as many key/value heads": (
        {Keys.Attention.HEAD_COUNT_KV: [1, 1, 1, 1]},
        {},
        "twice",
    ),
    "RoPE scaling": (
        {Keys.Rope.SCALING_TYPE: "linear", Keys.Rope.SCALING_FACTOR: 2.0},
        {},
        "linear",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(family, tmp_path, case):
    metadata, tensors, message = REFUSED[case]
    path = write_mimo2(tmp_path / "m.gguf", family[0], metadata=metadata, tensors=tensors)
    with pytest.raises(UnsupportedError, match=message):
        load_model(path, CPU, "f32")


# Each layer cached with its own key/value heads, 24 features wide (values padded), keys
# and values in f32: the global layer's 1 head 192 bytes a position for all 8192, the
# three sliding layers' 2 heads 384 bytes a position for at most 5.
CACHE_BYTES_8K = 192 * 8192 + 384 * 3 * 5


def test_show_describes_a_mimo2_gguf(family, tmp_path):
    path = write_mimo2(tmp_path / "m.gguf", family[0])
    check_show(path, ARCH, CACHE_BYTES_8K, moe=True)
    assert kv_cache_bytes(family[0].config.to_dict(), 8192) == CACHE_BYTES_8K


def test_show_counts_a_hub_folder_s_cache_as_the_model_allocates_it(family, tmp_path):
    """Xiaomi's config names (hybrid_layer_pattern, sliding_window_size) read alike by
    `llmrun show` (torch-free) and by the model."""
    from llmrun.loading import inspect

    path = hub_folder(family[0], tmp_path / "hub", fused_qkv=False)
    config = json.loads((path / "config.json").read_text())
    assert inspect.kv_cache_bytes(config, 8192) == kv_cache_bytes(config, 8192)
    assert inspect.kv_cache_bytes(config, 8192) == CACHE_BYTES_8K


def test_the_released_shape_caches_each_layer_in_its_own_shape():
    """MiMoV2FlashConfig's defaults (the released model: 9 global layers with 4 key/value
    heads, 39 sliding ones with 8 and a window of 129, head_dim 192): the cache the model
    allocates, `llmrun show`'s count and the per-layer formula agree, values padded to
    the keys' 192 features."""
    from types import SimpleNamespace

    from llmrun.loading import inspect
    from llmrun.models.mimo_v2_flash import Model, ModelArgs

    config = transformers.MiMoV2FlashConfig().to_dict()
    context, f16 = 512, 2
    kinds = config["layer_types"]
    formula = sum(
        2 * heads * 192 * f16 * (context if kind == "full_attention" else 129)
        for heads, kind in ((4 if k == "full_attention" else 8, k) for k in kinds)
    )
    assert kinds.count("full_attention") == 9
    # The model's new_cache, without building its 48 layers of weights.
    args = SimpleNamespace(args=ModelArgs.from_config(config))
    cache = Model.new_cache(args, 1, context, torch.float16, "cpu")
    assert [cache.layer_shape(i)[0] for i in range(48)] == [
        4 if k == "full_attention" else 8 for k in kinds
    ]
    assert cache.nbytes == formula
    assert kv_cache_bytes(config, context, f16) == formula
    assert inspect.kv_cache_bytes(config, context, f16) == formula


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    check_run_and_show(hf, write_mimo2(tmp_path / "m.gguf", hf), ARCH)
