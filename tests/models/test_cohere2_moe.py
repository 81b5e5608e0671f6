"""Cohere 2 MoE (cohere2_moe, Command A MoE) against transformers' Cohere2MoeForCausalLM,
from a Hugging Face folder (transformers 5 saves the experts stacked; the loader splits
them) and from "cohere2moe" GGUFs written as llama.cpp's converter writes them
(conversion/command_r.py Cohere2MoeModel: TextModel's keys with key_length, the dense
prefix's width as feed_forward_length, expert_feed_forward_length,
leading_dense_block_count, the sliding_window_pattern array, expert_gating_func and
expert_weights_norm, the shared experts' count and width; q/k rows as they are, the
experts stacked per projection; multi-token-prediction layers after the trunk's).

Four layers, windows of 5 under 40 tokens: layer 0 dense and global (rotated: the
dense prefix's force_rope), layer 2 global and without RoPE, layers 1 and 3 sliding;
heads of 32 in a hidden size of 64 with 4 heads. Each feature (the sigmoid router and
its renormalization, the shared experts and how they join, the dense prefix's RoPE,
the RMSNorm or LayerNorm, the logit scale) moves the logits by far more than the
tolerance, and llmrun follows each.

Tolerances: f32 logits 1e-4 max abs against transformers, whole, prefilled in chunks or
decoded one token at a time, contiguous or paged. A Q8_0 GGUF: 1e-4 against transformers
running the Q8_0-rounded weights. An f16 or bf16 cache: 1e-5 against an f32 cache that
stores the rounded values, and DRIFT from f32. The native decode step is not attached.
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
from gguf import ExpertGatingFuncType, Keys
from helpers import BASE, cached_logits, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import cohere2_moe, inspect
from llmrun.loading.loader import load_model
from llmrun.models.cohere2_moe import ModelArgs

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
THETA = 10000.0
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
COHERE2_MOE = dict(
    BASE,
    model_type="cohere2_moe",
    num_hidden_layers=4,
    head_dim=32,
    sliding_window=5,
    layer_types=LAYER_TYPES,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    prefix_dense_intermediate_size=64,
    intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_shared_experts=2,
    expert_selection_fn="sigmoid",
    norm_topk_prob=True,
    logit_scale=0.5,
    rope_theta=THETA,
    rms_norm_eps=1e-5,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 ~3e-3, bf16 ~5e-2 (a rounding can
# move a router's choice).
DRIFT = {"f16": 2e-2, "bf16": 0.5}
VARIANTS = {"rms-norm": {}, "layer-norm": dict(rms_norm_eps=None)}


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**COHERE2_MOE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf, tmp_path) -> torch.nn.Module:
    """llmrun's model of `hf`'s saved folder (transformers 5's stacked experts)."""
    hf.save_pretrained(tmp_path / "hf")
    return load_model(tmp_path / "hf", CPU, "f32").model


def check_three_ways(model, expected: torch.Tensor) -> None:
    check_whole_and_cached(model, IDS, expected)
    assert max_diff(cached_logits(model, IDS, chunks=(10,)), expected) < 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request, tmp_path_factory):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf), ours(hf, tmp_path_factory.mktemp("hf"))


# ---- GGUF as llama.cpp's converter writes it -------------------------------------------

_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def converted(hf) -> dict[str, np.ndarray]:
    """GGUF tensors of `hf`: the Hub's per-expert matrices stacked per projection."""
    width = hf.config.intermediate_size
    out = {}
    for key, tensor in hf.state_dict().items():
        data = tensor.float().numpy()
        if key.endswith("experts.gate_up_proj"):
            layer = key.split(".")[2]
            out[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :width]
            out[f"blk.{layer}.ffn_up_exps.weight"] = data[:, width:]
            continue
        if key.endswith("experts.down_proj"):
            out[f"blk.{key.split('.')[2]}.ffn_down_exps.weight"] = data
            continue
        module, _, suffix = key.rpartition(".")
        if module in _GLOBAL:
            if module != "lm_head" or not hf.config.tie_word_embeddings:
                out[f"{_GLOBAL[module]}.{suffix}"] = data
            continue
        _, _, layer, rest = module.split(".", 3)
        out[f"blk.{layer}.{_NAMES[rest]}.{suffix}"] = data
    return out


def write_cohere2_moe_gguf(path, hf, qtype=None, mtp=False, extra=None, fused=False):
    """The GGUF llama.cpp writes for `hf`; with `mtp`, one multi-token-prediction layer
    after the trunk (block_count + 1, nextn_predict_layers 1, its tensors); with
    `fused`, the experts' gate and up stacks as one ffn_gate_up_exps (--fuse-gate-up-exps)."""
    config = hf.config
    shared = config.num_shared_experts
    keys = {
        Keys.LLM.BLOCK_COUNT: config.num_hidden_layers + int(mtp),
        Keys.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        Keys.LLM.EMBEDDING_LENGTH: config.hidden_size,
        Keys.LLM.FEED_FORWARD_LENGTH: config.prefix_dense_intermediate_size,
        Keys.Attention.HEAD_COUNT: config.num_attention_heads,
        Keys.Attention.HEAD_COUNT_KV: config.num_key_value_heads,
        Keys.Rope.FREQ_BASE: THETA,
        Keys.Attention.LAYERNORM_RMS_EPS: config.rms_norm_eps,
        Keys.Attention.LAYERNORM_EPS: float(config.layer_norm_eps),
        Keys.LLM.EXPERT_COUNT: config.num_experts,
        Keys.LLM.EXPERT_USED_COUNT: config.num_experts_per_tok,
        Keys.LLM.EXPERT_GATING_FUNC: int(
            ExpertGatingFuncType.SIGMOID
            if config.expert_selection_fn == "sigmoid"
            else ExpertGatingFuncType.SOFTMAX
        ),
        Keys.Attention.KEY_LENGTH: config.head_dim,
        Keys.Attention.VALUE_LENGTH: config.head_dim,
        Keys.LLM.LOGIT_SCALE: float(config.logit_scale),
        Keys.Attention.SLIDING_WINDOW: config.sliding_window,
        Keys.Attention.SLIDING_WINDOW_PATTERN: [t == "sliding_attention" for t in LAYER_TYPES],
        Keys.LLM.VOCAB_SIZE: config.vocab_size,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: config.intermediate_size,
        Keys.LLM.LEADING_DENSE_BLOCK_COUNT: config.mlp_layer_types.count("dense"),
        Keys.LLM.EXPERT_WEIGHTS_NORM: bool(config.norm_topk_prob),
        Keys.LLM.EXPERT_SHARED_COUNT: shared or None,
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: config.intermediate_size * shared or None,
        Keys.LLM.NEXTN_PREDICT_LAYERS: 1 if mtp else None,
        Keys.Rope.DIMENSION_COUNT: config.head_dim,
        Keys.Rope.SCALING_TYPE: "none",
    }
    keys.update(extra or {})
    tensors = converted(hf)
    if fused:
        for layer in range(1, config.num_hidden_layers):
            gate = tensors.pop(f"blk.{layer}.ffn_gate_exps.weight")
            up = tensors.pop(f"blk.{layer}.ffn_up_exps.weight")
            tensors[f"blk.{layer}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    if mtp:  # the MTP block: a copy of the last layer and its NextN tensors
        last = config.num_hidden_layers - 1
        for name, data in list(tensors.items()):
            if name.startswith(f"blk.{last}."):
                tensors[name.replace(f"blk.{last}.", f"blk.{last + 1}.")] = data
        hidden = config.hidden_size
        tensors[f"blk.{last + 1}.nextn.eh_proj.weight"] = np.ones((hidden, 2 * hidden))
        tensors[f"blk.{last + 1}.nextn.enorm.weight"] = np.ones(hidden)
        tensors[f"blk.{last + 1}.nextn.hnorm.weight"] = np.ones(hidden)
    return write_keyed_gguf(path, cohere2_moe.ARCH, keys, tensors, qtype)


def test_hf_folder_matches_transformers(family):
    hf, expected, model = family
    assert expected.abs().max() > 3
    check_three_ways(model, expected)


def test_a_hub_folder_of_per_expert_tensors_loads(family, tmp_path):
    """The Hub's checkpoints hold each expert's matrices (mlp.experts.N.gate_proj.weight,
    as llama.cpp's converter reads them): they load by name."""
    from safetensors.torch import save_file

    hf, expected, _ = family
    width, state = hf.config.intermediate_size, {}
    for key, tensor in hf.state_dict().items():
        prefix, _, part = key.rpartition(".")
        if part == "gate_up_proj":
            for e, expert in enumerate(tensor):
                state[f"{prefix}.{e}.gate_proj.weight"] = expert[:width].clone()
                state[f"{prefix}.{e}.up_proj.weight"] = expert[width:].clone()
        elif part == "down_proj" and prefix.endswith("experts"):
            for e, expert in enumerate(tensor):
                state[f"{prefix}.{e}.down_proj.weight"] = expert.clone()
        elif key != "lm_head.weight":
            state[key] = tensor.clone()
    hf.config.to_json_file(tmp_path / "config.json")
    save_file(state, tmp_path / "model.safetensors")
    check_three_ways(load_model(tmp_path, CPU, "f32").model, expected)


@pytest.mark.parametrize(
    "layout", [{}, dict(mtp=True), dict(fused=True)], ids=["trunk", "with-mtp-layer", "fused"]
)
def test_gguf_matches_transformers(family, layout, tmp_path):
    hf, expected, _ = family
    loaded = load_model(write_cohere2_moe_gguf(tmp_path / "m.gguf", hf, **layout), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "cohere2_moe" and config["num_hidden_layers"] == 4
    assert config["layer_types"] == LAYER_TYPES and config["head_dim"] == 32
    check_three_ways(loaded.model, expected)


def test_q8_0_gguf_matches_transformers_on_the_rounded_weights(family, tmp_path):
    """Every matrix (the embedding and the expert stacks too) but the router in Q8_0;
    the reference is transformers with those weights rounded through Q8_0."""
    hf, expected, _ = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    loaded = load_model(write_cohere2_moe_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    rounded = hf_model(rms_norm_eps=hf.config.rms_norm_eps)
    with torch.no_grad():
        for key, p in rounded.named_parameters():
            if p.dim() >= 2 and not key.endswith("mlp.gate.weight"):
                data = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                p.copy_(torch.from_numpy(data.reshape(p.shape)))
    rounded_logits = reference(rounded)
    assert max_diff(rounded_logits, expected) > 1e-3  # the rounding shows
    check_three_ways(loaded.model, rounded_logits)


@pytest.mark.parametrize(
    "variant",
    [
        dict(expert_selection_fn="softmax"),
        dict(norm_topk_prob=False),
        dict(num_shared_experts=0),
        dict(shared_expert_combination_strategy="sum"),
        dict(prefix_dense_sliding_window_pattern=2),  # the dense layer 0 unrotated
        dict(mlp_layer_types=["sparse"] * 4),
        dict(head_dim=16),
        dict(logit_scale=0.0625),
    ],
    ids=["softmax", "unnormalized", "no-shared", "shared-summed", "prefix-nope", "no-dense",
         "head-dim", "logit-scale"],
)  # fmt: skip
def test_each_feature_moves_the_logits_and_is_followed(variant, tmp_path):
    expected = reference(hf_model())
    hf = hf_model(**variant)
    changed = reference(hf)
    assert max_diff(changed, expected) > 0.1
    check_three_ways(ours(hf, tmp_path), changed)


def test_a_config_with_first_k_dense_replace_lays_out_the_layers_as_transformers():
    """A Hub config.json may give the dense prefix as first_k_dense_replace, without
    layer_types: llmrun's defaults are transformers' (each part in its pattern)."""
    config = dict(
        COHERE2_MOE,
        num_hidden_layers=9,
        first_k_dense_replace=2,
        prefix_dense_sliding_window_pattern=2,
        sliding_window_pattern=3,
    )
    del config["layer_types"], config["mlp_layer_types"]
    hf = transformers.AutoConfig.for_model(**config)
    args = ModelArgs.from_config(config)
    assert args.layer_types == hf.layer_types and args.mlp_layer_types == hf.mlp_layer_types


def test_the_moe_routes_to_every_expert():
    hf = hf_model()
    seen = []
    hook = hf.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[2]))
    reference(hf)
    hook.remove()
    assert seen[0].shape[-1] == 2 and set(seen[0].flatten().tolist()) == set(range(8))


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    hf, _, _ = family
    loaded = load_model(write_cohere2_moe_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.model.decode_step is None


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    hf, expected, model = family
    check_paged(model, IDS, expected, windowed="cohere2_moe", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected, model = family
    check_typed_cache(model, IDS, expected, cache_type, DRIFT[cache_type])


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    path = write_cohere2_moe_gguf(tmp_path / "c.gguf", hf)
    check_run_and_show(hf, path, cohere2_moe.ARCH)
    # Two global layers, two holding their window of 5: 2 * 2 KV heads * 32 * 4 bytes each.
    assert inspect.describe(path)["kv_cache_bytes_8k"] == 512 * (2 * 8192 + 2 * 5)


@pytest.mark.parametrize(
    "extra, error, message",
    [
        ({Keys.LLM.EXPERT_WEIGHTS_NORM: False, Keys.LLM.EXPERT_GATING_FUNC: 1},
         UnsupportedError, "router"),
        ({Keys.LLM.EXPERT_WEIGHTS_SCALE: 2.5}, UnsupportedError, "scales"),
        ({Keys.Rope.FREQ_BASE_SWA: 500.0}, UnsupportedError, "one base"),
        ({Keys.LLM.LEADING_DENSE_BLOCK_COUNT: 9}, ModelFormatError, "leading_dense"),
        ({Keys.Attention.LAYERNORM_RMS_EPS: None, Keys.Attention.LAYERNORM_EPS: None},
         ModelFormatError, "epsilon"),
    ],
    ids=["softmax-unnormalized", "weights-scale", "swa-base", "dense-count", "no-eps"],
)  # fmt: skip
def test_what_llmrun_does_not_run_is_refused(extra, error, message, tmp_path):
    path = write_cohere2_moe_gguf(tmp_path / "m.gguf", hf_model(), extra=extra)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")
