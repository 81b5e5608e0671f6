"""Laguna (poolside Laguna XS.2, S.2, M.1; llama.cpp's "laguna" GGUFs): an RMSNorm over
each query and key head before RoPE, a head count of each layer's own
(num_attention_heads_per_layer; the key/value heads are the same throughout), global
layers and sliding-window layers (layer_types) each with their RoPE (rope_parameters
keyed by layer type: by default the global layers rotate half of a head with base 5e5,
the sliding ones all of it with base 1e4), and attention outputs scaled before o_proj
by softplus(g_proj(x)): one gate per head (gating true or "per-head") or per feature
("per-element"). Dense feed-forwards where mlp_layer_types says "dense" (the first
layer by default), experts elsewhere: each token's top k by sigmoid score (of router
logits tanh-soft-capped at moe_router_logit_softcapping where above 0) +
e_score_correction_bias, weighted by the unbiased scores renormalized over the k,
times moe_routed_scaling_factor, plus one shared expert shared_expert_intermediate_size
wide.

Reference: transformers/models/laguna/modeling_laguna.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    LayerTypes,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    check_top_k,
    mix_experts,
    rope_parameters,
    route_grouped,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache
from llmrun.models.qwen3_moe import MLP

# LagunaConfig's RoPE of each layer type where a config gives none.
DEFAULT_ROPE = {
    "full_attention": {
        "rope_type": "default",
        "rope_theta": 500000.0,
        "partial_rotary_factor": 0.5,
    },
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
GATINGS = {True: "per-head", "per-head": "per-head", "per-element": "per-element"}
MLP_TYPES = ("dense", "sparse")


@dataclass
class ModelArgs:
    # LagunaConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 8192  # the dense layers'
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = 512
    layer_types: list[str] | None = None
    num_attention_heads_per_layer: list[int] | None = None
    gating: bool | str = True
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    mlp_layer_types: list[str] | None = None
    moe_routed_scaling_factor: float = 1.0
    moe_apply_router_weight_on_input: bool = False
    moe_router_logit_softcapping: float = 0.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # global layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        self.layer_types = windowed_layer_types(
            self.layer_types or ["full_attention"] * layers, layers, self.sliding_window
        )
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(layers, 1) + ["sparse"] * (layers - 1)
        if len(self.mlp_layer_types) != layers or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types is {self.mlp_layer_types!r}: it needs one of "
                f"{', '.join(MLP_TYPES)} for each of the {layers} layers"
            )
        heads = self.num_attention_heads_per_layer or [self.num_attention_heads] * layers
        if len(heads) != layers or any(h % self.num_key_value_heads for h in heads):
            raise ModelFormatError(
                f"num_attention_heads_per_layer is {heads!r}: it needs a multiple of the "
                f"{self.num_key_value_heads} key/value heads for each of the {layers} layers"
            )
        self.num_attention_heads_per_layer = list(heads)
        if self.gating not in GATINGS:
            raise UnsupportedError(
                f"Laguna gating {self.gating!r} is not supported "
                '(true, "per-head" or "per-element")'
            )
        if self.moe_apply_router_weight_on_input:
            raise UnsupportedError(
                "Laguna with moe_apply_router_weight_on_input=true is not supported "
                "(transformers does not run it either)"
            )
        check_top_k(self.num_experts_per_tok, self.num_experts)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        ropes = rope_by_layer_type(config)
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        # sliding_window: null is no window.
        args = args_from_config(cls, flat, nullable=("sliding_window",))
        args.rope_parameters = ropes["full_attention"]
        args.rope_local_parameters = ropes["sliding_attention"]
        return args

    @property
    def per_head_gate(self) -> bool:
        return GATINGS[self.gating] == "per-head"

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return self.mlp_layer_types[layer] == "sparse"

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


def rope_by_layer_type(
    config: dict[str, Any], defaults: dict[str, dict[str, Any]] = DEFAULT_ROPE
) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE settings (base.rope_parameters' form) from the config's
    rope_parameters keyed by layer type, `defaults` (LagunaConfig's; Mellum's are its
    own) where it has none."""
    nested = config.get("rope_parameters") or defaults
    if not set(nested) <= set(defaults):
        raise ModelFormatError(
            f"rope_parameters has {sorted(nested)}; it is keyed by layer type "
            f"({', '.join(defaults)})"
        )
    plain = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    return {
        kind: rope_parameters({**plain, "rope_parameters": dict(nested.get(kind) or default)})
        for kind, default in defaults.items()
    }


class Attention(nn.Module):
    """Per-head q/k norms, the layer type's RoPE and window, the softplus output gate."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads_per_layer[layer],
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.layer_type = args.layer_types[layer]
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=bias)
        self.per_head_gate = args.per_head_gate
        gates = self.n_heads if self.per_head_gate else q_width
        self.g_proj = nn.Linear(args.hidden_size, gates, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

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
        # attend_scaled: the sliding layers' cache may keep only their window (frame.plan).
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale)
        gate = F.softplus(self.g_proj(x).float()).to(out.dtype)
        if self.per_head_gate:
            # [B, T, H*D] -> [B, T, H, D], one gate per head
            out = (out.view(batch, tokens, self.n_heads, self.head_dim) * gate[..., None]).flatten(
                2
            )
        else:
            out = out * gate
        return self.o_proj(out)


class Router(nn.Module):
    """Each token's experts and their weights, from logits taken to f32."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, top_k] in x's dtype and expert indices [N, top_k]."""
        a = self.args
        logits = F.linear(x, self.weight).float()
        cap = a.moe_router_logit_softcapping
        if cap > 0:
            logits = torch.tanh(logits / cap) * cap
        weights, indices = route_grouped(
            logits,
            a.num_experts_per_tok,
            scoring="sigmoid",
            bias=self.e_score_correction_bias.float(),
            normalize=True,
            scale=a.moe_routed_scaling_factor,
        )
        return weights.to(x.dtype), indices


class MoE(nn.Module):
    """Routed experts plus the shared expert every token goes through."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = Router(args)
        width = args.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(args, width) for _ in range(args.num_experts))
        self.shared_experts = MLP(args, args.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.gate(x2)
        return mix_experts(x2, weights, indices, self.experts).view(x.shape) + self.shared_experts(
            x
        )


class Layer(deepseek_v2.Layer):
    moe = MoE


class Model(LayerTypes, CausalLM):
    attention = Attention
    layer = Layer

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, self.attention, GatedMLP, self.layer)
        self.model.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, args.max_position_embeddings
        )
