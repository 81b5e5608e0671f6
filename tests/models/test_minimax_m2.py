"""MiniMax-M2 against transformers' MiniMaxM2ForCausalLM: from config.json-style dicts
with the Hub's per-expert weights (block_sparse_moe.experts.N.w1/w2/w3), from a Hub
folder whose config.json is written as MiniMaxAI's is (rotary_dim, rope_theta at the top
level, MiniMax's own switches at their released values), and from "minimax-m2" GGUFs
written as llama.cpp's converter writes them (conversion/minimax.py MiniMaxM2Model:
TextModel's keys, expert_gating_func sigmoid from scoring_func, expert_feed_forward_length
and rope.dimension_count, q/k rows as they are, the experts stacked, the selection bias
as exp_probs_b.bias, the router kept in f32).

Its features each move the logits by far more than the tolerance
(test_each_feature_changes_the_logits): the q/k norms, taken over the whole projection
(not per head), RoPE on rotary_dim of each head's features, sigmoid scores, the
selection bias that only chooses, and the renormalized weights.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time) or serve's paged
blocks. A Q8_0 GGUF is held to transformers running the dequantized weights at 1e-4.
Cache types are held to an f32 cache holding the rounded values (test_cache_types).
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_and_show,
    check_served_as_alone,
    check_show,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import BASE, cached_logits, our_model
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
    save_hub_dir,
)
from test_cache_types import TOLERANCE
from test_deepseek import routed_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
# MiniMax-M2's shape, small: GQA, heads of 32 of which rotary_dim 16 turn, 8 experts.
MINIMAX = dict(
    BASE,
    model_type="minimax_m2",
    head_dim=32,
    rotary_dim=16,
    num_local_experts=8,
    num_experts_per_tok=3,
    rope_theta=5e6,
)
# What MiniMaxAI's config.json sets that transformers' config does not read.
RELEASED_SWITCHES = dict(
    use_qk_norm=True,
    qk_norm_type="per_layer",
    scoring_func="sigmoid",
    use_routing_bias=True,
    shared_intermediate_size=0,
    shared_moe_mode="sigmoid",
    layernorm_full_attention_beta=1.0,
    layernorm_linear_attention_beta=1.0,
    layernorm_mlp_beta=1.0,
    attn_type_list=[1, 1],
    sliding_window=None,
    swa_rope_theta=-1.0,
    use_mtp=True,
    num_mtp_modules=3,
    mtp_transformer_layers=1,
    router_jitter_noise=0.0,
)
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers MiniMax-M2 (test_deepseek.routed_model's weights: attention
    outputs small, so that tokens do not look alike to the routers)."""
    model = routed_model({**MINIMAX, **overrides})
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:  # selection biases large enough to change the choice
            bias = layer.mlp.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=draw) * 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub's keys: transformers 5 fuses each layer's experts
    (mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I]) and renames
    block_sparse_moe to mlp; the checkpoints have one key per expert and projection."""
    out = {}
    for key, value in model.state_dict().items():
        head, sep, tail = key.partition(".mlp.")
        if not sep:
            out[key] = value
        elif tail == "experts.gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.block_sparse_moe.experts.{e}.w1.weight"] = value[e, :width].clone()
                out[f"{head}.block_sparse_moe.experts.{e}.w3.weight"] = value[e, width:].clone()
        elif tail == "experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{head}.block_sparse_moe.experts.{e}.w2.weight"] = value[e].clone()
        else:
            out[f"{head}.block_sparse_moe.{tail}"] = value
    return out


def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": 32, "num_key_value_heads": 4}])
def test_matches_transformers_whole_and_through_the_cache(overrides):
    hf = hf_model(**overrides)
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert (cached_logits(model, IDS) - expected).abs().max() < 1e-4


def test_every_expert_is_chosen():
    """The tests route tokens to every expert of every layer (so each expert's weights
    are checked)."""
    hf = hf_model()
    chosen = [set() for _ in hf.model.layers]
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, _i, out, seen=seen: seen.update(out[2].flatten().tolist())
        )
        for layer, seen in zip(hf.model.layers, chosen, strict=True)
    ]
    reference(hf)
    for hook in hooks:
        hook.remove()
    assert all(seen == set(range(MINIMAX["num_local_experts"])) for seen in chosen)


def test_a_hub_folder_with_the_released_config_loads(tmp_path):
    """config.json as MiniMaxAI writes it: rope_theta and rotary_dim at the top level
    (no rope_parameters), MiniMax's switches at their released values; the weights one
    per expert in two shards."""
    hf = hf_model()
    config = {k: v for k, v in MINIMAX.items()}
    config.update(RELEASED_SWITCHES, architectures=["MiniMaxM2ForCausalLM"])
    folder = save_hub_dir(tmp_path / "hf", config, hub_state_dict(hf))
    loaded = load_model(folder, CPU, "f32")
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_an_fp8_release_is_refused(tmp_path):
    hf = hf_model()
    quantized = dict(quant_method="fp8", fmt="float8_e4m3fn", weight_block_size=[128, 128])
    config = {**MINIMAX, "quantization_config": quantized}
    folder = save_hub_dir(tmp_path / "hf", config, hub_state_dict(hf))
    with pytest.raises(UnsupportedError, match="fp8 checkpoints are not supported"):
        load_model(folder, CPU, "f32")


SWITCHES_REFUSED = {
    "per-head q/k norms": {"qk_norm_type": "per_head"},
    "no q/k norms": {"use_qk_norm": False},
    "softmax scores": {"scoring_func": "softmax"},
    "no selection bias": {"use_routing_bias": False},
    "a shared expert": {"shared_intermediate_size": 256},
    "a routed scale": {"routed_scaling_factor": 2.5},
    "lightning attention": {"attn_type_list": [0, 1]},
    "grouped routing": {"num_expert_group": 4},
    "a sliding window": {"sliding_window": 16},
    "residual betas": {"layernorm_mlp_beta": 0.5},
}


@pytest.mark.parametrize("case", list(SWITCHES_REFUSED))
def test_a_config_asking_for_what_transformers_does_not_compute_is_refused(case):
    from llmrun.models import model_module

    with pytest.raises(UnsupportedError, match="MiniMax-M2 with"):
        model_module("minimax_m2").ModelArgs.from_config({**MINIMAX, **SWITCHES_REFUSED[case]})


class PerHeadNorm(torch.nn.Module):
    """A whole-projection RMSNorm's weights applied per head, as Qwen3 normalizes."""

    def __init__(self, norm, head_dim: int) -> None:
        super().__init__()
        self.norm, self.head_dim = norm, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, self.head_dim))
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-5)
        return heads.flatten(-2) * self.norm.weight


def route_without(renormalize: bool = True, sigmoid: bool = True):
    """A MiniMax-M2 router's forward with its renormalization or sigmoid (for softmax)
    left out."""
    import torch.nn.functional as F

    def forward(self, x, bias):
        logits = F.linear(x.reshape(-1, self.hidden_dim), self.weight)
        scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
        index = torch.topk(scores + bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, index)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, index

    return forward


def without(feature: str, hf):
    """A copy of `hf` (same weights) computing without `feature`."""
    import copy
    import types

    model = copy.deepcopy(hf)
    for layer in model.model.layers:
        attn, moe = layer.self_attn, layer.mlp
        if feature == "whole-projection q/k norms":
            attn.q_norm = PerHeadNorm(attn.q_norm, attn.head_dim)
            attn.k_norm = PerHeadNorm(attn.k_norm, attn.head_dim)
        elif feature == "q/k norms":
            attn.q_norm = attn.k_norm = torch.nn.Identity()
        elif feature == "selection bias":
            moe.e_score_correction_bias.zero_()
        elif feature == "renormalized weights":
            moe.gate.forward = types.MethodType(route_without(renormalize=False), moe.gate)
        elif feature == "sigmoid scores":
            moe.gate.forward = types.MethodType(route_without(sigmoid=False), moe.gate)
    return model


FEATURES = [
    "whole-projection q/k norms",
    "q/k norms",
    "partial rotary",
    "selection bias",
    "renormalized weights",
    "sigmoid scores",
]


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_changes_the_logits(feature):
    """Each feature, left out of the reference (same weights otherwise), moves the
    logits by far more than the parity tolerance: the parity tests check every one."""
    hf = hf_model()
    if feature == "partial rotary":
        changed = hf_model(rotary_dim=MINIMAX["head_dim"])
        changed.load_state_dict(hf.state_dict())
    else:
        changed = without(feature, hf)
    assert (reference(changed) - reference(hf)).abs().max() > 0.1


def test_paged_cache_gives_the_contiguous_logits():
    """serve's paged KV cache (test_paged.py's checks)."""
    hf = hf_model()
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values. Only f16's
    drift from f32 is bounded: in bf16 or q8_0 a rounding can send a token to other
    experts."""
    f16 = cache_type == "f16"
    check_rounded_cache(ours(hf_model()), cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_the_static_decode_step_is_not_offered():
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: MiniMax-M2 decodes through its forward."""
    from llmrun import static_decode

    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


# ---- GGUF, as llama.cpp's converter writes "minimax-m2" --------------------------------

LAYER_NAMES = MOE_LAYER_GGUF_NAMES


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: rows as they are, experts stacked
    [E, rows, cols], the selection bias as exp_probs_b.bias."""
    return fused_experts_gguf_tensors(
        model, LAYER_NAMES, {"mlp.e_score_correction_bias": "exp_probs_b.bias"}
    )


def minimax_keys(config) -> dict:
    """The "{arch}" keys the converter writes: TextModel's (expert_gating_func from the
    released config's scoring_func, key/value length from head_dim) and MiniMaxM2Model's."""
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
        L.EXPERT_COUNT: c.num_local_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GATING_FUNC: 2,  # ExpertGatingFuncType.SIGMOID
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.EXPERT_FEED_FORWARD_LENGTH: c.intermediate_size,
        R.DIMENSION_COUNT: c.rotary_dim,
    }


def write_minimax(path, model, qtype=None, metadata=None):
    """A minimax-m2 GGUF of the model: the converter's metadata (with `metadata`
    changed; None leaves a key out), its tensors, 2-D and 3-D ones but the router in
    `qtype` (default F32), stories260K's tokenizer."""
    keys = {**minimax_keys(model.config), **(metadata or {})}
    return write_keyed_gguf(path, "minimax-m2", keys, gguf_tensors(model), qtype)


def test_a_minimax_m2_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_minimax(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "minimax_m2"
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_gguf_without_a_rope_dimension_count_turns_whole_heads(tmp_path):
    """llama.cpp's n_rot where rope.dimension_count is absent: the head size."""
    hf = hf_model(rotary_dim=MINIMAX["head_dim"])
    path = write_minimax(tmp_path / "m.gguf", hf, metadata={Keys.Rope.DIMENSION_COUNT: None})
    loaded = load_model(path, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds blocks of each row, the
    rows of transformers' tensors)."""
    hf = hf_model()
    path = write_minimax(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


REFUSED = {
    "no gating function": ({Keys.LLM.EXPERT_GATING_FUNC: None}, ModelFormatError),
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    "no expert width": ({Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: None}, ModelFormatError),
    "experts of another width": ({Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: 48}, ModelFormatError),
    "expert groups": ({Keys.LLM.EXPERT_GROUP_COUNT: 4}, UnsupportedError),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError),
    "an odd rotated width": ({Keys.Rope.DIMENSION_COUNT: 7}, ModelFormatError),
    "experts used differing by layer": ({Keys.LLM.EXPERT_USED_COUNT: [3, 2]}, UnsupportedError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_minimax(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_describes_a_minimax_m2_gguf(tmp_path):
    path = write_minimax(tmp_path / "m.gguf", hf_model())
    # 2 layers of keys and values: 2 heads of 32, f32, 8192 positions.
    check_show(path, "minimax-m2", 2 * 2 * 2 * 32 * 4 * 8192, moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    path = write_minimax(tmp_path / "m.gguf", hf)
    check_run_and_show(hf, path, "minimax-m2")


def test_serve_gives_concurrent_requests_their_text_alone(tmp_path):
    """serve's scheduler (paged KV blocks, rows prefilled and decoded together) on a
    Q8_0 file: each request gets the text it gets alone."""
    from llmrun import api
    from llmrun.sampling import SamplingParams

    path = write_minimax(tmp_path / "m.gguf", hf_model(), GGMLQuantizationType.Q8_0)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (engine.tokenizer.encode(p), SamplingParams(seed=i, temperature=0.8))
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)
