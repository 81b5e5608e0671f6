"""Step 3.5 (StepFun's Step-3.5-Flash, and the language model of Step-3.7; llama.cpp's
"step35" GGUFs): sliding-window layers mixed with global ones (layer_types), each type
with a RoPE base and rotated share of its own (released: the global layers rotate half
of each head, the sliding ones all of it) and the sliding layers with a head count of
their own (num_sliding_attention_heads, the same key/value heads); an RMSNorm over each
query and key head; the attention output of each head gated by sigmoid(g_proj(x)); every
RMSNorm scaling by 1 + weight; pre-norm blocks whose feed-forward is dense in the
layers mlp_layer_types marks so (the first three by default) and else experts: each
token's top k by sigmoid score + e_score_correction_bias, weighted by the unbiased
scores renormalized, times moe_router_scaling_factor, plus a shared expert
share_expert_dim wide. SwiGLU may be clamped per layer (swiglu_limits for the routed
experts, swiglu_limits_shared for the shared expert and the dense feed-forwards):
silu(gate) at most the limit, up within +-limit.

StepFun's own config.json names (num_attention_groups, moe_num_experts, moe_top_k,
moe_layers_enum, attention_other_setting, per-layer rope_theta and
partial_rotary_factors lists, num_nextn_predict_layers' trailing entries) are read as
transformers reads them; the multi-token-prediction layers past num_hidden_layers are
skipped. Bidirectional attention is refused.

Reference: transformers/models/step3p7/modeling_step3p7.py (Step3p7TextModel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    LAYER_TYPES,
    CausalLM,
    Frame,
    GemmaRMSNorm,
    LayerTypes,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    check_layer_types,
    check_top_k,
    mix_experts,
    rope_parameters,
    route_grouped,
    sliding_windows,
)
from llmrun.models.cache import KVCache

MLP_TYPES = ("dense", "sparse")
LEADING_DENSE = 3  # Step3p7TextConfig: the dense layers where a config names none
# StepFun's config.json names, by transformers' names for them.
HUB_NAMES = {
    "num_key_value_heads": "num_attention_groups",
    "n_routed_experts": "moe_num_experts",
    "num_experts_per_tok": "moe_top_k",
    "share_expert_dim": "share_expert_dims",
}
PER_LAYER = ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared")


@dataclass
class ModelArgs:
    # Step3p7TextConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 11264  # the dense layers'
    moe_intermediate_size: int = 1280
    share_expert_dim: int = 1280
    num_key_value_heads: int = 8
    num_sliding_attention_heads: int | None = None
    head_dim: int = 128
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    moe_router_scaling_factor: float = 1.0
    norm_expert_weight: bool = True
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    swiglu_limits: list[float | None] | None = None
    swiglu_limits_shared: list[float | None] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 128000
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # The global layers' RoPE (the Body's), and the sliding layers'.
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    local_rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * layers
        self.layer_types = check_layer_types(self.layer_types, layers)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [MLP_TYPES[i >= LEADING_DENSE] for i in range(layers)]
        if len(self.mlp_layer_types) != layers or set(self.mlp_layer_types) - set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types is {self.mlp_layer_types!r}: one of {', '.join(MLP_TYPES)} "
                f"for each of the {layers} layers"
            )
        for name in ("swiglu_limits", "swiglu_limits_shared"):
            limits = getattr(self, name)
            if limits is not None and len(limits) != layers:
                raise ModelFormatError(f"{name} lists {len(limits)} layers, not {layers}")
        if self.num_sliding_attention_heads is None:
            self.num_sliding_attention_heads = self.num_attention_heads
        if self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = self.head_dim
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelFormatError("layer_types has sliding_attention layers but no sliding_window")
        for heads in (self.num_attention_heads, self.num_sliding_attention_heads):
            if heads % self.num_key_value_heads:
                raise ModelFormatError(
                    f"{heads} attention heads do not share {self.num_key_value_heads} "
                    "key/value heads evenly"
                )
        check_top_k(self.num_experts_per_tok, self.n_routed_experts)

    def layer_heads(self, layer: int) -> int:
        sliding = self.layer_types[layer] == "sliding_attention"
        return self.num_sliding_attention_heads if sliding else self.num_attention_heads

    def limit(self, layer: int, shared: bool) -> float | None:
        """The SwiGLU clamp of `layer`'s routed experts (or, `shared`, its shared expert
        or dense feed-forward); None (a missing list, a 0 or null entry): no clamp."""
        limits = self.swiglu_limits_shared if shared else self.swiglu_limits
        return (limits[layer] or None) if limits else None

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = _transformers_names(config)
        args = args_from_config(cls, {**config, "rope_parameters": None})
        rope = _layer_ropes(config, args.layer_types)
        lengths = {"max_position_embeddings": args.max_position_embeddings}
        full = rope.get("full_attention") or rope["sliding_attention"]
        local = rope.get("sliding_attention") or full
        args.rope_parameters = rope_parameters({"rope_parameters": full, **lengths})
        args.local_rope_parameters = rope_parameters({"rope_parameters": local, **lengths})
        return args


def _transformers_names(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with StepFun's own fields turned into transformers' (as
    Step3p7TextConfig.__post_init__ reads them), the trailing multi-token-prediction
    entries of its per-layer lists cut; refused where it asks for what transformers'
    model does not compute."""
    config = dict(config)
    if config.get("use_bidirectional_attention"):
        raise UnsupportedError("Step 3.5 with use_bidirectional_attention is not supported")
    if config.get("gating", True) not in (True, "per-head"):
        raise UnsupportedError(
            f"Step 3.5 with gating {config['gating']!r} is not supported (per-head gates only)"
        )
    for name, hub in HUB_NAMES.items():
        if config.get(name) is None and config.get(hub) is not None:
            config[name] = config[hub]
    layers = config["num_hidden_layers"]
    padded = layers + (config.get("num_nextn_predict_layers") or 0)
    for name in (*PER_LAYER, "rope_theta", "partial_rotary_factors"):
        value = config.get(name)
        if isinstance(value, list) and len(value) == padded:
            config[name] = value[:layers]
    enum = config.get("moe_layers_enum")
    if config.get("mlp_layer_types") is None and enum is not None:
        items = enum.split(",") if isinstance(enum, str) else enum
        sparse = {int(i) for i in items if str(i).strip()}
        config["mlp_layer_types"] = [MLP_TYPES[i in sparse] for i in range(layers)]
    other = config.get("attention_other_setting") or {}
    if config.get("num_sliding_attention_heads") is None and "num_attention_heads" in other:
        config["num_sliding_attention_heads"] = other["num_attention_heads"]
    kv = other.get("num_attention_groups", config.get("num_key_value_heads"))
    if kv != config.get("num_key_value_heads"):
        raise UnsupportedError(
            f"Step 3.5 with {kv} key/value heads on the sliding layers and "
            f"{config.get('num_key_value_heads')} on the others is not supported"
        )
    return config


def _layer_ropes(config: dict[str, Any], layer_types: list[str]) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE settings: transformers' rope_parameters by layer type, or
    StepFun's per-layer rope_theta and partial_rotary_factors lists (each type's from
    its first layer) with rope_scaling on the global layers."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and all(isinstance(rope.get(t), dict) for t in set(layer_types)):
        return {t: dict(rope[t]) for t in LAYER_TYPES if t in rope}
    thetas = config.get("rope_theta", 10000.0)
    factors = config.get("partial_rotary_factors")
    out = {}
    for kind in set(layer_types):
        i = layer_types.index(kind)
        params = {"rope_type": "default"}
        params["rope_theta"] = thetas[i] if isinstance(thetas, list) else thetas
        if factors:
            params["partial_rotary_factor"] = factors[i]
        out[kind] = params
    if config.get("rope_scaling") and "full_attention" in out:
        out["full_attention"].update(config["rope_scaling"])
    return out


class Attention(nn.Module):
    """Per-head q/k norms, the layer type's RoPE and window, a sigmoid gate per head."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads = layer, args.layer_heads(layer)
        self.n_kv_heads, self.head_dim = args.num_key_value_heads, args.head_dim
        self.layer_type = args.layer_types[layer]
        self.scale = args.query_pre_attn_scalar**-0.5
        dim, q_width = args.hidden_size, self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(dim, q_width, bias=False)
        self.k_proj = nn.Linear(dim, kv_width, bias=False)
        self.v_proj = nn.Linear(dim, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, dim, bias=False)
        self.g_proj = nn.Linear(dim, self.n_heads, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], each head normalized on its own
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q.transpose(1, 2)), frame.rotate(k.transpose(1, 2))
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale)
        # [B, T, H*D] -> [B, T, H, D], each head times its gate
        gate = torch.sigmoid(self.g_proj(x))[..., None]
        out = (out.view(batch, tokens, self.n_heads, self.head_dim) * gate).flatten(2)
        return self.o_proj(out)


class MLP(nn.Module):
    """down(glu(gate(x), up(x))) of a given width, its SwiGLU clamped by `limit`."""

    def __init__(self, args: ModelArgs, width: int, limit: float | None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)
        self.limit = limit

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, each clamped (silu(gate) <= limit, |up| <= limit) where the
        layer has a limit."""
        gate = F.silu(gate)
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return gate * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    """transformers' Step3p7TopKRouter: its weight and selection bias."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))


class MoE(nn.Module):
    """Routed experts by sigmoid score + bias, plus the shared expert."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.args, self.top_k = args, args.num_experts_per_tok
        self.gate = Router(args)
        limit = args.limit(layer, shared=False)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size, limit) for _ in range(args.n_routed_experts)
        )
        self.shared_experts = MLP(args, args.share_expert_dim, args.limit(layer, shared=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        logits = F.linear(x2.float(), self.gate.weight.float())
        weights, indices = route_grouped(
            logits,
            self.top_k,
            "sigmoid",
            self.gate.e_score_correction_bias.float(),
            normalize=self.args.norm_expert_weight,
            scale=self.args.moe_router_scaling_factor,
        )
        out = mix_experts(x2, weights.to(x.dtype), indices, self.experts).view(x.shape)
        return out + self.shared_experts(x)


class Layer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): dense or experts by mlp_layer_types."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        if args.mlp_layer_types[layer] == "sparse":
            self.mlp = MoE(args, layer)
        else:
            self.mlp = mlp(args, args.intermediate_size, args.limit(layer, shared=True))
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frames, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        super().__init__(args, Attention, MLP, Layer, norm)
        self.model.rotary_emb_local = RotaryEmbedding(
            args.local_rope_parameters, args.head_dim, args.max_position_embeddings
        )
