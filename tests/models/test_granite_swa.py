"""Granite 4 with sliding-window attention (granite_swa, and granitemoe_swa with its
experts and shared expert) against transformers, from a Hugging Face folder (the
experts fused, split by the loader) and from "granite_swa" GGUFs written as llama.cpp's
converter writes them (conversion/granite.py GraniteSWAModel / GraniteMoeSWAModel:
Granite's *_scale keys, Llama's permuted q/k rows, sliding_window and
sliding_window_pattern, rope_pattern for NoPE layers, the sinks as attn_sinks, the
experts' gate/up kept fused as ffn_gate_up_exps and the shared expert's as ffn_up_shexp).

Four layers, windows of 5 under 40 tokens: layer 0 full, the others sliding; layer 2
without RoPE (NoPE). Each feature (the sinks, the windows, the NoPE layer, a RoPE base
of its own for one layer, the shared expert) moves the logits by far more than the
tolerance, and llmrun follows each.

Tolerances: f32 logits (within about ±4) 1e-4 max abs against transformers, whole,
prefilled in chunks or decoded one token at a time, contiguous or paged. A Q8_0 GGUF:
1e-4 against transformers running the Q8_0-rounded weights. An f16 or bf16 cache: 1e-5
against an f32 cache that stores the rounded values, and DRIFT from f32. The native
decode step is not attached (it has no sinks).
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from gguf import Keys
from helpers import BASE, _permute, cached_logits, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import granite, inspect
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
THETA = 10000.0
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
DENSE = dict(
    BASE,
    model_type="granite_swa",
    num_hidden_layers=4,
    sliding_window=5,
    layer_types=LAYER_TYPES,
    layer_rope_theta=[THETA, THETA, 0, THETA],
    rope_parameters=dict(rope_type="default", rope_theta=THETA),
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.3,  # not head_dim^-0.5 (0.25)
    logits_scaling=2.0,
    tie_word_embeddings=True,
)
MOE = dict(
    DENSE,
    model_type="granitemoe_swa",
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=32,
    shared_intermediate_size=64,
    tie_word_embeddings=False,
)
CONFIGS = {"granite_swa": DENSE, "granitemoe_swa": MOE}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 7e-3, bf16 3e-2 (dense) and 0.3
# (MoE: a rounding that moves a router's choice).
DRIFT = {"f16": 2e-2, "bf16": 0.5}


def hf_model(model_type: str, **overrides):
    """transformers' model, randomize()'s weights; sinks N(0, 2) so they matter."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIGS[model_type], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"sinks": 10.0})
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def check_three_ways(model, expected: torch.Tensor) -> None:
    """Whole, prefilled in chunks then decoded, and a prefill of 10 then decoded: each
    within 1e-4 of `expected`."""
    check_whole_and_cached(model, IDS, expected)
    assert max_diff(cached_logits(model, IDS, chunks=(10,)), expected) < 1e-4


def ours(hf, tmp_path) -> torch.nn.Module:
    """llmrun's model of `hf`'s saved folder (the Hub's layout: experts fused)."""
    hf.save_pretrained(tmp_path / "hf")
    return load_model(tmp_path / "hf", CPU, "f32").model


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    """The model type, transformers' model, its logits and llmrun's model of its folder."""
    hf = hf_model(request.param)
    return request.param, hf, reference(hf), ours(hf, tmp_path_factory.mktemp("hf"))


# ---- GGUF as llama.cpp's converter writes it -------------------------------------------

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.sinks": "attn_sinks.weight",  # GraniteSWAModel.filter_tensors adds .weight
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.experts.gate_up_proj": "ffn_gate_up_exps.weight",  # kept fused
    "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
    "shared_mlp.input_linear.weight": "ffn_up_shexp.weight",  # gate rows, then up rows
    "shared_mlp.output_linear.weight": "ffn_down_shexp.weight",
}


def converted(hf) -> dict[str, np.ndarray]:
    """GGUF tensors of `hf`'s state dict, as the converter names and lays them out."""
    config = hf.config
    out = {}
    for key, tensor in hf.state_dict().items():
        data = tensor.float().numpy()
        module, _, suffix = key.rpartition(".")
        if module in _GLOBAL:
            if module != "lm_head" or not config.tie_word_embeddings:
                out[f"{_GLOBAL[module]}.{suffix}"] = data
            continue
        _, _, layer, rest = key.split(".", 3)
        if rest == "self_attn.q_proj.weight":
            data = _permute(data, config.num_attention_heads)
        elif rest == "self_attn.k_proj.weight":
            data = _permute(data, config.num_key_value_heads)
        out[f"blk.{layer}.{_LAYER[rest]}"] = data
    return out


def write_swa_gguf(path, hf, qtype=None, extra=None, drop=()):
    """The GGUF llama.cpp writes for `hf` (no key_length: the converter drops head_dim),
    rope_pattern as it writes it from a config's no_rope_layers. `extra`: more keys;
    `drop`: keys left out."""
    config = hf.config
    keys = {
        Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        Keys.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        Keys.LLM.EMBEDDING_LENGTH: config.hidden_size,
        Keys.LLM.FEED_FORWARD_LENGTH: config.intermediate_size,
        Keys.Attention.HEAD_COUNT: config.num_attention_heads,
        Keys.Attention.HEAD_COUNT_KV: config.num_key_value_heads,
        Keys.Attention.LAYERNORM_RMS_EPS: float(config.rms_norm_eps),
        Keys.Rope.FREQ_BASE: THETA,
        Keys.Rope.DIMENSION_COUNT: config.hidden_size // config.num_attention_heads,
        Keys.LLM.VOCAB_SIZE: config.vocab_size,
        Keys.Attention.SCALE: float(config.attention_multiplier),
        Keys.LLM.EMBEDDING_SCALE: float(config.embedding_multiplier),
        Keys.LLM.RESIDUAL_SCALE: float(config.residual_multiplier),
        Keys.LLM.LOGIT_SCALE: float(config.logits_scaling),
        Keys.Attention.SLIDING_WINDOW: config.sliding_window,
        Keys.Attention.SLIDING_WINDOW_PATTERN: [t == "sliding_attention" for t in LAYER_TYPES],
        granite.ROPE_PATTERN: [bool(t) for t in config.layer_rope_theta],
    }
    if getattr(config, "num_local_experts", None):
        keys[Keys.LLM.EXPERT_COUNT] = config.num_local_experts
        keys[Keys.LLM.EXPERT_USED_COUNT] = config.num_experts_per_tok
        keys[Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH] = config.shared_intermediate_size
    keys.update(extra or {})
    keys = {k: v for k, v in keys.items() if k not in drop}
    return write_keyed_gguf(path, granite.SWA_ARCH, keys, converted(hf), qtype)


def test_hf_folder_matches_transformers(family):
    model_type, hf, expected, model = family
    assert model.args.layer_rope_theta == [THETA, THETA, 0, THETA]
    check_three_ways(model, expected)


def test_gguf_matches_transformers(family, tmp_path):
    model_type, hf, expected, _ = family
    loaded = load_model(write_swa_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == model_type
    assert config["layer_types"] == LAYER_TYPES and config["sliding_window"] == 5
    assert config["layer_rope_theta"] == [THETA, THETA, 0.0, THETA]
    check_three_ways(loaded.model, expected)


def test_q8_0_gguf_matches_transformers_on_the_rounded_weights(family, tmp_path):
    """Every matrix (the embedding and the expert stacks too) but the router in Q8_0;
    the reference is transformers with those weights rounded through Q8_0."""
    model_type, hf, expected, _ = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    loaded = load_model(write_swa_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    rounded = hf_model(model_type)
    with torch.no_grad():
        for key, p in rounded.named_parameters():
            if p.dim() >= 2 and "router" not in key:
                data = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                p.copy_(torch.from_numpy(data.reshape(p.shape)))
    rounded_logits = reference(rounded)
    assert max_diff(rounded_logits, expected) > 1e-3  # the rounding shows
    check_three_ways(loaded.model, rounded_logits)


@pytest.mark.parametrize(
    "variant",
    [
        dict(sinks=True),  # sinks zeroed
        dict(layer_types=["full_attention"] * 4),
        dict(layer_rope_theta=[THETA] * 4),
        dict(layer_rope_theta=[THETA, 500.0, 0, THETA]),
        dict(shared_intermediate_size=0),
    ],
    ids=["sinks", "windows", "nope", "own-theta", "shared-expert"],
)
def test_each_feature_moves_the_logits_and_is_followed(variant, tmp_path):
    """Each feature, changed, moves transformers' logits by far more than the tolerance,
    and llmrun gives the changed model's logits."""
    expected = reference(hf_model("granitemoe_swa"))
    overrides = {k: v for k, v in variant.items() if k != "sinks"}
    hf = hf_model("granitemoe_swa", **overrides)
    if "sinks" in variant:
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.sinks.zero_()
    changed = reference(hf)
    assert max_diff(changed, expected) > 0.1
    check_three_ways(ours(hf, tmp_path), changed)


def test_the_moe_routes_to_every_expert():
    """The tokens reach every expert of the first layer, two per token, so every expert's
    rows of the fused stacks are checked."""
    hf = hf_model("granitemoe_swa")
    seen = []
    hook = hf.model.layers[0].block_sparse_moe.router.register_forward_hook(
        lambda m, i, out: seen.append(out[2])
    )
    reference(hf)
    hook.remove()
    assert seen[0].shape[-1] == 2 and set(seen[0].flatten().tolist()) == set(range(8))


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """The native step has no sinks: a GGUF of the family decodes through the torch
    layers (whose logits test_gguf_matches_transformers checks)."""
    _, hf, _, _ = family
    loaded = load_model(write_swa_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.model.decode_step is None


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks: shuffled blocks (f32, f16), rows sharing prefix blocks,
    and the windowed layers in a pool of their own whose blocks are let go and reused."""
    model_type, hf, expected, model = family
    check_paged(model, IDS, expected, windowed=model_type, monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    _, hf, expected, model = family
    check_typed_cache(model, IDS, expected, cache_type, DRIFT[cache_type])


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model("granitemoe_swa")
    path = write_swa_gguf(tmp_path / "swa.gguf", hf)
    check_run_and_show(hf, path, "granite_swa")
    # One full layer, three holding their window of 5: 2 * 2 KV heads * 16 * 4 bytes each.
    assert inspect.describe(path)["kv_cache_bytes_8k"] == 256 * (8192 + 3 * 5)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(extra={granite.DEEPSTACK_MAPPING: [-1, 1, -1, -1]}), UnsupportedError, "Vision"),
        (dict(drop=(Keys.Attention.SLIDING_WINDOW_PATTERN,)), ModelFormatError, "pattern"),
        (dict(extra={granite.ROPE_PATTERN: [True]}), ModelFormatError, "rope_pattern"),
        (dict(drop=(Keys.Attention.SLIDING_WINDOW,)), ModelFormatError, "sliding_window"),
    ],
    ids=["vision", "no-pattern", "short-rope-pattern", "no-window"],
)
def test_what_llama_cpp_refuses_or_llmrun_does_not_run_is_refused(change, error, message, tmp_path):
    path = write_swa_gguf(tmp_path / "m.gguf", hf_model("granite_swa"), **change)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")
