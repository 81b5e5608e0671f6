"""DeepSeek V2 and V3 (multi-head latent attention, DeepSeekMoE) against transformers'
DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: from config.json-style dicts with the
Hub's per-expert weights, and from "deepseek2" GGUFs written as llama.cpp's converter
writes them (conversion/deepseek.py: MQA head_count_kv 1, kv_b_proj split per head into
attn_k_b (transposed) and attn_v_b, or the older single attn_kv_b; stacked experts;
e_score_correction_bias as exp_probs_b.bias; the YaRN log multiplier as 0.1 *
mscale_all_dim).

Tolerances: 1e-4 on logits within about ±6 in f32 (measured ~6e-6), through the KV
cache (chunked prefill, then one token at a time), the paged cache and the static one.
A Q8_0 GGUF is held to transformers running the dequantized weights at 1e-4 (the
native kernels multiply the blocks exactly in f32). Cache types are held to the f32
cache at test_cache_types' tolerances. The cache holds one latent head per token and
layer (llama.cpp's absorbed MLA), checked by its shape and bytes; in bf16 the logits are
held to f32 transformers within 1.5x of transformers' own bf16 error.
"""

import numpy as np
import pytest
import test_paged
import torch
from family_checks import (
    check_rounded_cache,
    check_run_prints_greedy_tokens,
    check_served_as_alone,
    check_show,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from gguf.quants import dequantize, quantize
from helpers import cached_logits, our_model, randomize
from test_cache_types import TOLERANCE

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models.paged import PagedKVCache

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,  # keys of 64; the cached latent head is 32 + 32 too
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=0.707,
)
CONFIGS = {
    # V2-Lite's shape: plain q_proj, softmax over all experts.
    "v2-lite": dict(
        model_type="deepseek_v2", q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0
    ),
    # V2/V2.5: q LoRA, group_limited_greedy over 4 groups, scaled weights, YaRN.
    "v2": dict(
        model_type="deepseek_v2",
        q_lora_rank=32,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
        rope_parameters=YARN,
    ),
    # V3/R1/Kimi K2: sigmoid scores, biased noaux_tc choice in 4 groups, YaRN.
    "v3": dict(
        model_type="deepseek_v3",
        q_lora_rank=32,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # Moonlight-like: no q LoRA, one group, no renormalization, half-split RoPE.
    "v3-plain": dict(
        model_type="deepseek_v3",
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.0,
        norm_topk_prob=False,
        rope_interleave=False,
        rope_theta=50000.0,
    ),
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def hf_model(name: str, **overrides):
    """A tiny transformers model of CONFIGS[name] (routed_model's weights)."""
    return routed_model({**COMMON, **CONFIGS[name], **overrides})


def routed_model(config: dict):
    """A tiny transformers model of `config` with randomize()'s weights (attention
    outputs smaller, so that tokens do not look alike to the routers), V3-style
    selection biases drawn large enough to change the choice."""
    config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.03})
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.3)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub's keys: one per expert and projection (transformers 5
    fuses them into experts.gate_up_proj [E, 2I, D] and experts.down_proj [E, D, I])."""
    out = {}
    for key, value in model.state_dict().items():
        head, sep, tail = key.partition(".mlp.experts.")
        if not sep:
            out[key] = value
        elif tail == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.gate_proj.weight"] = value[e, :width]
                out[f"{head}.mlp.experts.{e}.up_proj.weight"] = value[e, width:]
        else:
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.down_proj.weight"] = value[e]
    return out


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
    "selection bias": ("v3", {}),  # the biases zeroed below
    "noaux_tc groups": ("v3", {"n_group": 1, "topk_group": 1}),
    "group_limited_greedy": ("v2", {"topk_method": "greedy"}),
    "routed_scaling_factor": ("v3", {"routed_scaling_factor": 1.0}),
    "norm_topk_prob": ("v3", {"norm_topk_prob": False}),
    "rope_interleave": ("v3", {"rope_interleave": False}),
    # mscale == mscale_all_dim keeps RoPE's own factor at 1: only the softmax's changes.
    "mscale_all_dim": ("v2", {"rope_parameters": {**YARN, "mscale": 1e-9, "mscale_all_dim": 1e-9}}),
    "first_k_dense_replace": ("v2-lite", {"first_k_dense_replace": 0}),
    "shared experts": ("v2-lite", {"n_shared_experts": 0}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    name, change = FEATURES[feature]
    with_feature, without = hf_model(name), hf_model(name, **change)
    target = without.state_dict()
    same = {
        k: v
        for k, v in with_feature.state_dict().items()
        if k in target and target[k].shape == v.shape
    }
    without.load_state_dict(same, strict=False)
    if feature == "selection bias":
        for layer in without.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
    assert (reference(without) - reference(with_feature)).abs().max() > 0.1


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_paged_cache_gives_the_contiguous_logits(cache_type):
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py)."""
    hf = hf_model("v3")
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(ours, cache_type)


def test_paged_rows_decoded_together_give_their_own_logits():
    hf = hf_model("v2")
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(
        our_model(hf.config.to_dict(), hub_state_dict(hf))
    )


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values (what
    test_cache_types holds every family to). Only f16's drift from f32 is bounded: in
    bf16 or q8_0 a rounding can send a token to other experts."""
    hf = hf_model("v2")
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    f16 = cache_type == "f16"
    check_rounded_cache(ours, cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_the_cache_holds_one_latent_head_per_token():
    """As llama.cpp's MLA caches it: per token and layer one KV head of kv_lora_rank +
    qk_rope_head_dim features (64 + 32 here, where a head's key has 32 + 32), the values
    the keys' own buffer (stored once, in the paged pool too); the sizers count what the
    caches allocate."""
    from llmrun.models import kv_cache_bytes

    hf = hf_model("v3", kv_lora_rank=64)
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    cache = ours.new_cache(1, 10, torch.float32, "cpu")
    assert cache.k.shape == (3, 1, 1, 10, 96) and cache.v is cache.k
    assert cache.nbytes == cache.k.nbytes
    like = ours.new_cache(1, 1, torch.float32, "cpu")
    pool = PagedKVCache(like, 4, 16, 64)
    assert pool.v is pool.k and pool.nbytes == 4 * PagedKVCache.block_bytes(like, 16)
    assert kv_cache_bytes(hf.config.to_dict(), 10) == cache.nbytes
    assert inspect.kv_cache_bytes(hf.config.to_dict(), 10) == cache.nbytes
    assert (cached_logits(ours, IDS) - reference(hf)).abs().max() < 1e-4


# The released shapes (config.json fields that size the cache; the rest transformers'
# defaults) and their bf16 cache bytes per token: layers x (512 + 64) x 2 bytes, where
# every head's key and value took layers x 2 x heads x 192 (GLM: 256) x 2.
RELEASED = {
    "DeepSeek-V2-Lite": (
        dict(
            model_type="deepseek_v2",
            num_hidden_layers=27,
            num_attention_heads=16,
            q_lora_rank=None,
            n_routed_experts=64,
            num_experts_per_tok=6,
        ),
        31_104,  # was 331_776
    ),
    "DeepSeek-V3": (dict(model_type="deepseek_v3"), 70_272),  # was 5_996_544
    "GLM-4.7-Flash": (dict(model_type="glm4_moe_lite"), 54_144),  # was 962_560
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_models_cache_their_latents_bytes_per_token(name):
    from llmrun.models import kv_cache_bytes

    fields, per_token = RELEASED[name]
    config = transformers.AutoConfig.for_model(**fields).to_dict()
    assert kv_cache_bytes(config, 1000, 2) == 1000 * per_token
    assert inspect.kv_cache_bytes(config, 1000, 2) == 1000 * per_token


def test_bf16_logits_are_as_close_to_f32_as_transformers_bf16_ones():
    """The absorbed attention in bf16 (the queries taken into the latent space, the
    outputs expanded from it, in bf16 products that transformers does not compute) is
    held to f32 transformers as closely as transformers' own bf16 model is, within 1.5x
    (its error is ~0.12 on logits of ±6, ours ~0.1), whole and through a bf16 cache. Every
    layer dense: in bf16 a rounding can send a token to other experts, in either model."""
    hf = hf_model("v2-lite", first_k_dense_replace=3)
    expected = reference(hf)
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf)).to(torch.bfloat16)
    hf_error = (reference(hf.to(torch.bfloat16)).float() - expected).abs().max()
    cache = ours.new_cache(1, 64, torch.bfloat16, "cpu")
    with torch.no_grad():
        whole = ours(IDS, torch.arange(IDS.shape[1])[None])
        prefill = ours(IDS[:, :30], torch.arange(30)[None], cache)
        steps = [ours(IDS[:, [t]], torch.tensor([[t]]), cache) for t in range(30, IDS.shape[1])]
    cached = torch.cat([prefill, *steps], dim=1)
    for got in (whole, cached):
        assert (got - expected).abs().max() < 1.5 * hf_error


def test_a_v3_config_that_is_not_sigmoid_noaux_tc_is_refused():
    from llmrun.models import model_module

    module = model_module("deepseek_v3")
    config = {**COMMON, **CONFIGS["v3"], "scoring_func": "softmax"}
    with pytest.raises(UnsupportedError, match="scoring_func 'softmax'"):
        module.ModelArgs.from_config(config)


def test_a_hub_folder_loads_without_its_multi_token_prediction_layer(tmp_path):
    """The Hub's V3 checkpoints hold an extra layer (model.layers.61, multi-token
    prediction) that transformers ignores; so does llmrun. An FP8 one is refused."""
    import json

    from safetensors.torch import save_file

    hf = hf_model("v3")
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}
    save_file(extra, str(folder / "model-mtp.safetensors"))
    index = {"weight_map": {k: "model.safetensors" for k in hub_state_dict(hf)}}
    index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(folder, torch.device("cpu"), "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="fp8 checkpoints are not supported"):
        load_model(folder, torch.device("cpu"), "f32")


# ---- GGUF, as llama.cpp's converter writes "deepseek2" ----------------------------------


def gguf_tensors(model, split_kv: bool) -> dict[str, np.ndarray]:
    """GGUF name -> array, in llama.cpp's layout (conversion/deepseek.py)."""
    config = model.config
    heads, nope, v_dim = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.kv_b_proj": "attn_kv_b",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }
    out = {}
    state = model.state_dict()
    for key, value in state.items():
        data = value.float().numpy()
        if key == "model.embed_tokens.weight":
            out["token_embd.weight"] = data
            continue
        if key == "model.norm.weight":
            out["output_norm.weight"] = data
            continue
        if key == "lm_head.weight":
            out["output.weight"] = data
            continue
        _, _, layer, rest = key.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = data
        elif rest == "mlp.experts.gate_up_proj":
            width = data.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :width]
            out[f"blk.{layer}.ffn_up_exps.weight"] = data[:, width:]
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = data
        elif module == "self_attn.kv_b_proj" and split_kv:
            kv_b = data.reshape(heads, nope + v_dim, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = kv_b[:, :nope].transpose(0, 2, 1)
            out[f"blk.{layer}.attn_v_b.weight"] = kv_b[:, nope:]
        else:
            out[f"blk.{layer}.{names[module]}.{suffix}"] = data
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def deepseek2_keys(config, split_kv: bool) -> dict:
    """The "{arch}" keys llama.cpp's converter writes for the config."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    rope, qk = c.qk_rope_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim
    gating = 2 if c.model_type == "deepseek_v3" else 1  # ExpertGatingFuncType: sigmoid, softmax
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: 1,  # MLA written as MQA
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.n_routed_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GATING_FUNC: gating,
        L.LEADING_DENSE_BLOCK_COUNT: c.first_k_dense_replace,
        L.VOCAB_SIZE: c.vocab_size,
        A.KV_LORA_RANK: c.kv_lora_rank,
        # Files from before llama.cpp's MLA (attn_kv_b) give the head sizes as they are.
        A.KEY_LENGTH: c.kv_lora_rank + rope if split_kv else qk,
        A.VALUE_LENGTH: c.kv_lora_rank if split_kv else c.v_head_dim,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.EXPERT_SHARED_COUNT: c.n_shared_experts,
        L.EXPERT_WEIGHTS_SCALE: float(c.routed_scaling_factor),
        R.DIMENSION_COUNT: rope,
    }
    if c.n_group is not None:
        keys.update({L.EXPERT_GROUP_COUNT: c.n_group, L.EXPERT_GROUP_USED_COUNT: c.topk_group})
    if c.q_lora_rank is not None:
        keys[A.Q_LORA_RANK] = c.q_lora_rank
    if split_kv:
        keys.update({A.KEY_LENGTH_MLA: qk, A.VALUE_LENGTH_MLA: c.v_head_dim})
    if getattr(c, "norm_topk_prob", False):
        keys[L.EXPERT_WEIGHTS_NORM] = True
    params = c.rope_parameters
    if params.get("rope_type") == "yarn":
        keys.update({
            R.SCALING_TYPE: "yarn",
            R.SCALING_FACTOR: params["factor"],
            R.SCALING_ORIG_CTX_LEN: params["original_max_position_embeddings"],
            R.SCALING_YARN_BETA_FAST: params["beta_fast"],
            R.SCALING_YARN_BETA_SLOW: params["beta_slow"],
            R.SCALING_YARN_LOG_MUL: 0.1 * params["mscale_all_dim"],
        })  # fmt: skip
    return keys


def write_deepseek2(
    path, model, tensors: dict, qtype=None, split_kv=True, metadata=None, arch="deepseek2"
):
    """A deepseek2 GGUF of the model (or of `arch`, Mistral 4's "mistral4", which the
    converter writes alike): its metadata as the converter writes it (with `metadata`
    changed; None leaves a key out), `tensors` (gguf_tensors), 2-D and 3-D ones but the
    router in `qtype` (default F32)."""
    keys = {**deepseek2_keys(model.config, split_kv), **(metadata or {})}
    return write_keyed_gguf(path, arch, keys, tensors, qtype)


def gguf_logits(path) -> torch.Tensor:
    loaded = load_model(path, torch.device("cpu"), "f32")
    return cached_logits(loaded.model, IDS)


@pytest.mark.parametrize(
    "name,split_kv,model_type",
    [
        ("v3", True, "deepseek_v3"),
        ("v2", True, "deepseek_v2"),
        ("v2-lite", False, "deepseek_v2"),  # an older file: attn_kv_b, no gating key
    ],
)
def test_a_deepseek2_gguf_matches_transformers(tmp_path, name, split_kv, model_type):
    hf = hf_model(name)
    # Files older than the gating key are softmax-gated (llama.cpp's default).
    old = {Keys.LLM.EXPERT_GATING_FUNC: None} if not split_kv else {}
    tensors = gguf_tensors(hf, split_kv)
    path = write_deepseek2(tmp_path / "m.gguf", hf, tensors, split_kv=split_kv, metadata=old)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == model_type
    # The native decode step does not know MLA: it stays off.
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def q8_0(x: np.ndarray) -> np.ndarray:
    """x with each row's blocks of 32 rounded as Q8_0 stores them."""
    Q8_0 = GGMLQuantizationType.Q8_0
    return dequantize(quantize(np.ascontiguousarray(x), Q8_0), Q8_0)


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values: Q8_0 rounds each row's blocks, which
    are the rows of transformers' tensors, but for attn_k_b, whose rows are the
    transposed key part of kv_b_proj."""
    hf = hf_model("v3")
    path = write_deepseek2(
        tmp_path / "m.gguf", hf, gguf_tensors(hf, split_kv=True), GGMLQuantizationType.Q8_0
    )
    round_as_q8_0_gguf(hf)
    assert (gguf_logits(path) - reference(hf)).abs().max() < 1e-4


def round_as_q8_0_gguf(hf) -> None:
    """Round `hf`'s weights in place as a split-kv Q8_0 GGUF of it holds them."""
    c = hf.config
    state = {}
    for key, value in hf.state_dict().items():
        data = value.numpy()
        if "kv_b_proj" in key:
            kv_b = data.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k = q8_0(kv_b[:, : c.qk_nope_head_dim].transpose(0, 2, 1)).transpose(0, 2, 1)
            v = q8_0(kv_b[:, c.qk_nope_head_dim :])
            data = np.concatenate([k, v], axis=1).reshape(data.shape)
        elif data.ndim > 1 and not key.endswith("mlp.gate.weight"):
            data = q8_0(data)
        state[key] = torch.from_numpy(np.ascontiguousarray(data))
    hf.load_state_dict(state)


def test_a_q8_0_gguf_of_the_older_form_matches_transformers_on_the_dequantized_weights(
    tmp_path,
):
    """A file with attn_kv_b, every matrix but the router in Q8_0: the model reads
    kv_b_proj's rows, so the loader dequantizes it (the rows Q8_0 rounds are
    transformers' own here)."""
    hf = hf_model("v2-lite")
    old = {Keys.LLM.EXPERT_GATING_FUNC: None}
    tensors = gguf_tensors(hf, split_kv=False)
    Q8_0 = GGMLQuantizationType.Q8_0
    path = write_deepseek2(tmp_path / "m.gguf", hf, tensors, Q8_0, split_kv=False, metadata=old)
    state = {
        key: torch.from_numpy(q8_0(v.numpy())) if v.ndim > 1 and "mlp.gate." not in key else v
        for key, v in hf.state_dict().items()
    }
    hf.load_state_dict(state)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert type(loaded.model.model.layers[0].self_attn.kv_b_proj) is torch.nn.Linear
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


REFUSED = {
    # llama.cpp counts its steps in attention.temperature_length, which it then requires.
    "temperature without its length": ({Keys.Attention.TEMPERATURE_SCALE: 0.1}, ModelFormatError),
    "YaRN without its log multiplier": ({Keys.Rope.SCALING_YARN_LOG_MUL: None}, UnsupportedError),
    "no kv_lora_rank": ({Keys.Attention.KV_LORA_RANK: None}, ModelFormatError),
    "no q_lora_rank for attn_q_a": ({Keys.Attention.Q_LORA_RANK: None}, ModelFormatError),
    "no rope dimension count": ({Keys.Rope.DIMENSION_COUNT: None}, ModelFormatError),
    "an unknown gating function": ({Keys.LLM.EXPERT_GATING_FUNC: 3}, UnsupportedError),
    "softmax gating with a selection bias": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    "no layers but multi-token-prediction ones": (
        {Keys.LLM.NEXTN_PREDICT_LAYERS: 3},
        ModelFormatError,
    ),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    hf = hf_model("v3")
    path = write_deepseek2(tmp_path / "m.gguf", hf, gguf_tensors(hf, True), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, torch.device("cpu"), "f32")


def test_a_gguf_missing_an_expert_stack_is_refused(tmp_path):
    hf = hf_model("v3")
    tensors = gguf_tensors(hf, split_kv=True)
    del tensors["blk.1.ffn_gate_exps.weight"]
    path = write_deepseek2(tmp_path / "m.gguf", hf, tensors)
    with pytest.raises(ModelFormatError, match="missing tensors: model.layers.1.mlp.experts"):
        load_model(path, torch.device("cpu"), "f32")


def test_show_describes_a_deepseek2_gguf(tmp_path):
    hf = hf_model("v3")
    path = write_deepseek2(tmp_path / "m.gguf", hf, gguf_tensors(hf, split_kv=True))
    # Every layer's one latent head of 32 + 32, key and value alike (stored once), f32,
    # 8192 positions.
    check_show(path, "deepseek2", 3 * 64 * 4 * 8192, moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model("v3")
    path = write_deepseek2(tmp_path / "m.gguf", hf, gguf_tensors(hf, split_kv=True))
    check_run_prints_greedy_tokens(hf, path)


def test_serve_gives_concurrent_requests_their_text_alone(tmp_path):
    """serve's scheduler (paged KV blocks, rows prefilled and decoded together) on a
    Q8_0 file: each request gets the text it gets alone."""
    from llmrun import api
    from llmrun.sampling import SamplingParams

    hf = hf_model("v3")
    tensors = gguf_tensors(hf, split_kv=True)
    path = write_deepseek2(tmp_path / "m.gguf", hf, tensors, GGMLQuantizationType.Q8_0)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (engine.tokenizer.encode(p), SamplingParams(seed=i, temperature=0.8))
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)


def test_the_static_decode_step_is_not_offered():
    """The static step CUDA graphs capture (llmrun.static_decode) cannot hold a router
    that reads its choices back to the host: DeepSeek decodes through its forward."""
    from llmrun import static_decode

    hf = hf_model("v3")
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    assert not static_decode.supported(ours, ours.new_cache(1, 64, torch.float32, "cpu"))
