"""Ling 3 (llmrun/models/bailing_hybrid.py) against transformers' BailingHybridForCausalLM:
from its state dict, from folders as transformers saves them (the Hub's BailingMoeV3
names: word_embeddings, attention, dense, q/k/v_conv1d, expert_bias, one module per
expert) and as the Hub's config.json has them (model_type bailing_moe_v3, head_dim the
KDA heads' width, partial_rotary_factor, a multi-token-prediction layer), and from
"bailingmoe3" GGUFs written as llama.cpp's converter writes them (write_bailing_hybrid_gguf:
conversion/bailingmoe3.py, with every key src/models/bailingmoe3.cpp requires).

The tiny model: KDA layers 0 and 2, MLA layers 1 and 3 (layer_group_size 2; the KV
cache's layers are not the model's), KDA heads of 16 features and a RoPE part of 8 (so
the two head_dims are told apart), RoPE base 10000 (Ling's 6e6 would barely turn 40
positions); a dense first layer, then 8 sigmoid-routed experts in 4 groups of which 2
are taken, a random selection bias, a shared expert; SwiGLU clamps per layer (0.3/0.2
routed, 0.25/0.3 shared) that clamp many inputs; A_log near 0 and dt_bias -7..-3, so the
bounded forget gate decays slowly and the state carries tokens far. Each feature, taken
out of our model, moves the logits past 0.05 (test_each_feature_moves_the_logits).

Tolerances: 1e-4 on f32 logits within about ±3 against transformers (measured ~2e-5),
whole, through the KV cache and recurrent state (prefills in chunks, then one token at
a time), in padded batches, from serve's paged blocks (f16 blocks: 1e-2). A typed
(f16/bf16) KV cache: 1e-5 against an f32 cache that stores the rounded values, and less
than DRIFT from f32. A Q8_0 GGUF against an F32 GGUF of the same weights round-tripped
through Q8_0: 1e-4. The chunked KDA rule is Kimi Linear's, checked against the per-token
recurrence in test_kimi_linear.py; here a prefill of 3 then every token decoded (the
recurrence) and the chunked prefills both match transformers.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from family_checks import check_run_and_show, max_diff, write_keyed_gguf
from helpers import CHUNKS, cached_logits, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
    check_typed_cache_with_a_float32_state,
)
from test_kimi_linear import converted_layer_tensor, converter_quantizes, hub_names

from llmrun import api, models
from llmrun.errors import LlmrunError, ModelFormatError, UnsupportedError
from llmrun.loading import bailingmoe3, inspect
from llmrun.loading.loader import load_model
from llmrun.models import bailing_hybrid, deepseek_v2
from llmrun.models.base import GatedMLP
from llmrun.models.recurrent import RecurrentState
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="bailing_hybrid",
    vocab_size=512,  # stories260K's tokenizer
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=16,  # the KDA heads' width
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    layer_group_size=2,
    first_k_dense_replace=1,
    expert_swiglu_limit_list=[0.0, 0.3, 0.0, 0.2],
    share_expert_swiglu_limit_list=[0.0, 0.25, 0.3, 0.0],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
DRIFT = {"f16": 1e-2, "bf16": 1e-1}
ARCH = "bailingmoe3"


def hf_model(**overrides):
    """A transformers model of CONFIG (and `overrides`) with randomize()'s weights (the
    output matrix scaled down to keep logits within about ±3), slow bounded decays
    (A_log in -0.5..0.5, dt_bias in -7..-3) and a random selection bias (a buffer,
    which randomize() leaves at 0)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"lm_head.weight": 0.4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("dt_bias"):
                p.uniform_(-7.0, -3.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def ours(hf) -> torch.nn.Module:
    """Our model of `hf`'s config with its weights (Kimi Linear's renames: q/k/v
    convolutions, the forget gate's weights on the layer, one module per expert)."""
    model = bailing_hybrid.Model(bailing_hybrid.ModelArgs.from_config(hf.config.to_dict()))
    model.load_state_dict(hub_names(hf.state_dict()), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


# ---- the model against transformers ---------------------------------------------------


def test_whole_chunked_and_decoded_match_transformers(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 1
    cache = model.new_cache(1, 8, torch.float32, "cpu")
    assert cache.k.shape == (2, 1, 1, 8, 32 + 8)  # the MLA layers' latents, once
    assert cache.v is cache.k
    assert cache.recurrent.dtype == torch.float32
    assert isinstance(model.model.layers[0].mlp, GatedMLP)  # the dense first layer
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Prefills of CHUNKS (one of them a single token), then decode steps.
    assert max_diff(cached_logits(model, IDS, CHUNKS), expected) < 1e-4
    # A short prefill, then every token decoded through the cache (the recurrence).
    assert max_diff(cached_logits(model, IDS, (3,)), expected) < 1e-4


@pytest.mark.parametrize(
    "overrides",
    [
        dict(q_lora_rank=24),
        dict(kda_safe_gate=False),
        dict(share_expert_swiglu_limit_list=[0.05, 0.25, 0.3, 0.0]),
        dict(num_hidden_layers=6, layer_group_size=3, first_k_dense_replace=2,
             expert_swiglu_limit_list=None, share_expert_swiglu_limit_list=None),
    ],
    ids=["compressed queries", "unbounded gate", "dense layer limit", "groups of 3"],
)  # fmt: skip
def test_config_variants_match_transformers(overrides):
    """Queries through q_lora_rank, Kimi's unbounded forget gate, a shared-expert limit
    on the dense layer (which transformers never clamps), groups of three layers."""
    hf = hf_model(**overrides)
    expected = reference(hf)
    assert max_diff(cached_logits(ours(hf), IDS, (7, 9)), expected) < 1e-4


def _forgetful(part: int):
    read = RecurrentState.read

    def forgetful(self, layer):
        parts = read(self, layer)
        parts[part] = torch.zeros_like(parts[part])
        return parts

    return forgetful


def _unbounded(model) -> None:
    for layer in model.model.layers:
        if isinstance(layer.self_attn, bailing_hybrid.DeltaAttention):
            layer.self_attn.lower_bound = None


def _halves(model) -> None:
    for layer in model.model.layers:
        if isinstance(layer.self_attn, bailing_hybrid.Attention):
            layer.self_attn.interleaved = False


def _unclamped(model, shared: bool) -> None:
    for layer in model.model.layers[1:]:
        for expert in [layer.mlp.shared_experts] if shared else layer.mlp.experts:
            expert.limit = None


@pytest.mark.parametrize(
    "removed",
    [
        "conv state",
        "delta state",
        "bounded forget gate",
        "head-wise attention gate",
        "rope",
        "rope on adjacent pairs",
        "routed clamp",
        "shared clamp",
        "expert groups",
        "selection bias",
        "shared experts",
    ],
)
def test_each_feature_moves_the_logits(removed, monkeypatch, family):
    """Without each feature (the states a cache carries between forwards, the forget
    gate's lower bound, the MLA heads' output gates, RoPE and its adjacent pairs, the
    routed and shared experts' clamps, the group-limited routing, the selection bias,
    the shared experts) the cached logits move from transformers' by far more than the
    tolerance."""
    hf, expected = family
    model = ours(hf)
    if removed in ("conv state", "delta state"):
        monkeypatch.setattr(RecurrentState, "read", _forgetful(0 if removed == "conv state" else 1))
    elif removed == "bounded forget gate":
        _unbounded(model)
    elif removed == "head-wise attention gate":
        ungated = deepseek_v2.Attention.gated_output
        monkeypatch.setattr(bailing_hybrid.Attention, "gated_output", ungated)
    elif removed == "rope":
        monkeypatch.setattr(bailing_hybrid.Attention, "rotate", lambda self, x, frame: x)
    elif removed == "rope on adjacent pairs":
        _halves(model)
    elif removed in ("routed clamp", "shared clamp"):
        _unclamped(model, shared=removed == "shared clamp")
    elif removed == "expert groups":
        model.args.n_group = 1
    elif removed == "selection bias":
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.data.zero_()
    else:
        for layer in model.model.layers[1:]:
            layer.mlp.shared_experts = None
    assert max_diff(cached_logits(model, IDS, (7, 9)), expected) > 0.05


def test_padded_rows_of_a_batch_keep_their_own_state(family):
    """Rows of 12, 7 and 10 tokens prefilled together, padded on the right as the server
    pads them (a padded token repeats its row's last position), then decoded together:
    each row's logits are transformers' for it alone."""
    hf, _ = family
    check_padded_rows_decoded_together(ours(hf), lambda ids: reference(hf, ids), IDS)


def test_padded_rows_in_scattered_cache_rows(family):
    """Prompts of 9, 4 and 28 tokens padded on the right in rows 3, 0 and 2 of a cache,
    then a decode step each: transformers' logits for each alone (the padding left the
    states alone)."""
    hf, _ = family
    check_padded_rows_in_scattered_slots(ours(hf), lambda ids: reference(hf, ids), IDS)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_serves_from_paged_blocks(family, cache_type):
    """serve's paged KV blocks (shuffled) with the scheduler's recurrent state rows: a
    sequence prefilled in chunks that end inside blocks, then decoded."""
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected, cache_type=cache_type)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """The MLA layers' latents rounded to the type; the recurrent state stays float32."""
    hf, expected = family
    check_typed_cache_with_a_float32_state(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_or_native_decode_step(family):
    """CUDA graphs' static step keeps no recurrent state, and the native decode step
    does not know the family: neither is offered."""
    model = ours(family[0])
    check_no_static_decode(model)
    assert not set(bailing_hybrid.MODEL_TYPES) & set(decode_step.FAMILIES)
    assert model.decode_step is None


# ---- configs and Hugging Face folders ------------------------------------------------


def hub_config(hf) -> dict:
    """`hf`'s config as the Hub's config.json has it (BailingMoeV3): head_dim the KDA
    heads' width, no linear_* fields or layer lists, the Hub's names for the router's
    settings, partial_rotary_factor 0.5 (which RoPE ignores: it turns qk_rope_head_dim
    features), a multi-token-prediction layer whose clamps end the lists."""
    saved = hf.config.to_dict()
    config = {
        k: v
        for k, v in saved.items()
        if not k.startswith("linear_") and k not in ("layer_types", "mlp_layer_types")
    }
    config.update(
        model_type="bailing_moe_v3",
        architectures=["BailingMoeV3ForCausalLM"],
        head_dim=saved["linear_head_dim"],
        n_group=saved["num_expert_group"],
        num_experts_per_tok=saved["num_experts_per_token"],
        norm_topk_prob=True,
        max_position_embeddings=saved["model_max_length"],
        partial_rotary_factor=0.5,
        rope_parameters={**saved["rope_parameters"], "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=1,
        moe_shared_expert_intermediate_size=saved["moe_intermediate_size"],
        gated_attention_proj_granularity_type="head_wise",
        no_kda_lora=True,
        score_function="sigmoid",
        rope_interleave=True,
        expert_swiglu_limit_list=saved["expert_swiglu_limit_list"] + [0.5],
        share_expert_swiglu_limit_list=saved["share_expert_swiglu_limit_list"] + [0.5],
    )
    for name in ("num_expert_group", "num_experts_per_token", "model_max_length"):
        del config[name]
    return config


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    """A folder as transformers 5 saves it (the Hub's tensor names), and the same
    weights with the Hub's config.json and a multi-token-prediction layer after them."""
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    assert inspect.describe(tmp_path / "hf")["context_length"] == 256  # model_max_length
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "hf" / "model.safetensors")
    for key in [k for k in weights if k.startswith("model.layers.3.")]:
        weights[key.replace("layers.3.", "layers.4.")] = weights[key].clone()
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hub_config(hf)))
    hub = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(hub.model, IDS), expected) < 1e-4
    assert bailingmoe3.MODEL_TYPES == bailing_hybrid.MODEL_TYPES  # the torch-free mirror
    for form in (hub_config(hf), hf.config.to_dict()):  # show's count is the model's
        assert inspect.kv_cache_bytes(form, 8192) == 8192 * 2 * (32 + 8) * 4
        assert models.kv_cache_bytes(form, 8192) == 8192 * 2 * (32 + 8) * 4


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gated_attention_proj_granularity_type", "element_wise", "head_wise"),
        ("no_kda_lora", False, "low-rank KDA"),
        ("score_function", "softmax", "softmax"),
        ("rope_interleave", False, "rope_interleave"),
        ("moe_shared_expert_intermediate_size", 64, "moe_shared_expert_intermediate_size"),
        ("layer_group_size", 3, "incomplete group"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_configs_llmrun_cannot_run_are_refused(family, field, value, message):
    """What transformers' model does not compute (element-wise attention gates, LoRA
    gates, softmax routing, RoPE on halves, another shared-experts width), and layers
    that do not fill whole groups without layer_types (transformers and the Hub's code
    place their attention layers differently)."""
    config = {**hub_config(family[0]), field: value}
    with pytest.raises(UnsupportedError, match=message):
        bailing_hybrid.ModelArgs.from_config(config)


def test_the_hub_defaults_are_transformers():
    """A config.json with the sizes alone takes BailingHybridConfig's defaults."""
    sizes = dict(model_type="bailing_hybrid", hidden_size=64, num_hidden_layers=12,
                 num_attention_heads=4, vocab_size=512)  # fmt: skip
    args = bailing_hybrid.ModelArgs.from_config(sizes)
    expected = transformers.BailingHybridConfig(**sizes)
    assert args.layer_types == expected.layer_types
    assert args.mlp_layer_types == expected.mlp_layer_types
    assert args.rope_parameters["rope_theta"] == 6_000_000.0
    assert (args.linear_head_dim, args.linear_num_heads) == (128, 4)
    assert (args.n_routed_experts, args.n_group, args.topk_group) == (512, 8, 4)
    assert args.q_lora_rank is None and args.kda_lower_bound == -5.0


# ---- llama.cpp's GGUFs ---------------------------------------------------------------

_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.forget_gate.f_proj": "ssm_f_a",
    "self_attn.b_proj": "ssm_beta",
    "self_attn.o_norm": "ssm_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def converted_tensors(hf) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, as llama.cpp's converter transforms them:
    q/k/v convolutions [1, channels, 1, kernel], ssm_a = exp(A_log) [heads, 1], dt_bias
    as ssm_dt.bias, g_proj as attn_gate (MLA) or ssm_g_a (KDA), kv_b_proj split per
    head, experts stacked, expert_bias as exp_probs_b.bias."""
    c = hf.config
    out = {}
    for key, tensor in hf.state_dict().items():
        x = tensor.float().numpy().copy()
        if key in _GLOBALS:
            out[_GLOBALS[key]] = x
            continue
        _, _, layer, rest = key.split(".", 3)
        blk, full = f"blk.{layer}", c.layer_types[int(layer)] == "full_attention"
        if converted_layer_tensor(out, blk, rest, x, c):
            continue
        if rest == "self_attn.forget_gate.A_log":
            out[f"{blk}.ssm_a"] = np.exp(x).reshape(-1, 1)
        elif rest == "self_attn.g_proj.weight":
            out[f"{blk}.{'attn_gate' if full else 'ssm_g_a'}.weight"] = x
        else:
            out[f"{blk}.{_NAMES[rest.removesuffix('.weight')]}.weight"] = x
    return out


def write_bailing_hybrid_gguf(
    path, hf, qtype=None, round_trip=None, extra=None, mtp=False, **override
):
    """The model as llama.cpp's converter writes Ling 3 (BailingMoeV3Model): TextModel's
    keys (key_length, value_length from head_dim, then key_length overwritten) and its own
    (head_count_kv per layer, the KDA, MLA and experts' sizes, the per-layer clamps),
    the tensors converted (converted_tensors), matrices in `qtype`, or F32 rounded
    through `round_trip`; `extra`: more tensors; `mtp`: a multi-token-prediction layer
    after the others (block_count and the per-layer arrays count it). `override`:
    metadata keys (without the arch) to write instead, None to leave one out."""
    c = hf.config
    blocks = c.num_hidden_layers + int(mtp)
    kinds = c.layer_types + ["full_attention"] * int(mtp)
    limits = [float(v) for v in c.expert_swiglu_limit_list] + [0.0] * int(mtp)
    shared_limits = [float(v) for v in c.share_expert_swiglu_limit_list] + [0.0] * int(mtp)
    meta = {
        "block_count": blocks,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": [int(t == "full_attention") for t in kinds],
        "rope.freq_base": float(c.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        "expert_count": c.num_local_experts,
        "expert_used_count": c.num_experts_per_tok,
        "expert_group_count": c.n_group,
        "expert_group_used_count": c.topk_group,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim,
        "attention.value_length": c.linear_head_dim,
        "vocab_size": c.vocab_size,
        "ssm.conv_kernel": c.linear_conv_kernel_dim,
        "kda.head_dim": c.linear_head_dim,
        "kda.safe_gate": bool(c.kda_safe_gate),
        "kda.gate_lower_bound": float(c.kda_lower_bound),
        "attention.q_lora_rank": c.q_lora_rank,
        "attention.kv_lora_rank": c.kv_lora_rank,
        "rope.dimension_count": c.qk_rope_head_dim,
        "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
        "attention.value_length_mla": c.v_head_dim,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_shared_feed_forward_length": c.moe_intermediate_size * c.n_shared_experts,
        "expert_shared_count": c.n_shared_experts,
        "leading_dense_block_count": c.first_k_dense_replace,
        "expert_weights_scale": float(c.routed_scaling_factor),
        "expert_weights_norm": bool(c.norm_topk_prob),
        "swiglu_clamp_exp": limits,
        "swiglu_clamp_shexp": shared_limits,
        "nextn_predict_layers": 1 if mtp else None,
    }
    meta.update(override)
    tensors = converted_tensors(hf)
    if mtp:  # the next-token layer: its own norms and projections (copies of layer 3's)
        layer = c.num_hidden_layers
        for name, x in list(tensors.items()):
            if name.startswith(f"blk.{layer - 1}."):
                tensors[name.replace(f"blk.{layer - 1}.", f"blk.{layer}.")] = x.copy()
        width = c.hidden_size
        tensors[f"blk.{layer}.nextn.eh_proj.weight"] = np.zeros((width, 2 * width), np.float32)
        for norm in ("enorm", "hnorm"):
            tensors[f"blk.{layer}.nextn.{norm}.weight"] = np.ones(width, np.float32)
        tensors[f"blk.{layer}.layer_output_norm.weight"] = np.ones(width, np.float32)
    out = {}
    for name, x in {**tensors, **(extra or {})}.items():
        x = np.ascontiguousarray(x, dtype=np.float32)
        if round_trip is not None and converter_quantizes(name, x):
            rounded = gguf.quants.dequantize(gguf.quants.quantize(x, round_trip), round_trip)
            x = rounded.reshape(x.shape)
        out[name] = x
    keys = {f"{{arch}}.{name}": value for name, value in meta.items()}
    return write_keyed_gguf(path, ARCH, keys, out, qtype, whole_blocks=True)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_bailing_hybrid_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "bailing_hybrid"
    assert config["layer_types"] == hf.config.layer_types
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_with_compressed_queries_and_a_next_token_layer(tmp_path):
    """attention.q_lora_rank (Ling-3.0-tiny's queries: attn_q_a, attn_q_a_norm,
    attn_q_b), and an MTP layer after the others, which is skipped."""
    hf = hf_model(q_lora_rank=24)
    path = write_bailing_hybrid_gguf(tmp_path / "m.gguf", hf, mtp=True)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["num_hidden_layers"] == 4
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_holds_its_dequantized_weights(family, tmp_path):
    hf, expected = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    quantized = load_model(write_bailing_hybrid_gguf(tmp_path / "q.gguf", hf, qtype=q8), CPU, "f32")
    exact = load_model(
        write_bailing_hybrid_gguf(tmp_path / "r.gguf", hf, round_trip=q8), CPU, "f32"
    )
    assert quantized.checkpoint.weights["model.layers.0.self_attn.q_proj.weight"].ggml_type == q8
    got = cached_logits(quantized.model, IDS)
    assert max_diff(got, cached_logits(exact.model, IDS)) < 1e-4
    assert max_diff(got, expected) > 0  # the rounding shows


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"kda.safe_gate": False}, UnsupportedError, "safe_gate"),
        ({"kda.gate_lower_bound": None}, ModelFormatError, "gate_lower_bound"),
        ({"expert_gating_func": None}, ModelFormatError, "expert_gating_func"),
        ({"swiglu_clamp_shexp": [0.5, 0.25, 0.3, 0.0]}, UnsupportedError, "dense layer"),
        ({"expert_shared_feed_forward_length": 64}, UnsupportedError, "shared experts"),
        ({"rope.dimension_sections": [2, 1, 1, 0]}, UnsupportedError, "M-RoPE"),
        ({"rope.scaling.type": "yarn"}, UnsupportedError, "RoPE scaling"),
        ({"attention.head_count_kv": [0, 1, 0]}, ModelFormatError, "lists 3 layers"),
    ],
)
def test_files_llmrun_cannot_run_are_refused(family, tmp_path, override, error, message):
    """What llama.cpp would not run, what it requires, and where llama.cpp's graph and
    transformers' model differ."""
    path = write_bailing_hybrid_gguf(tmp_path / "m.gguf", family[0], **override)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")
    assert issubclass(error, LlmrunError)


def test_llmrun_run_and_show(family, tmp_path):
    hf, _ = family
    path = write_bailing_hybrid_gguf(tmp_path / "ling.gguf", hf)
    check_run_and_show(hf, path, ARCH)
    info = inspect.describe(path)
    # The two MLA layers' latents, stored once: kv_lora_rank + qk_rope_head_dim, f32.
    assert info["kv_cache_bytes_8k"] == 8192 * 2 * (32 + 8) * 4
    assert 0 < info["active_parameters"] < info["parameters"]


def test_serve_gives_concurrent_requests_transformers_greedy_text(family, tmp_path):
    """serve's scheduler: three prompts of different lengths decoded together, each
    given the text transformers' greedy search gives it alone."""
    hf, _ = family
    path = write_bailing_hybrid_gguf(tmp_path / "m.gguf", hf)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The cat", "One day, a little girl named Lily went"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=3)
