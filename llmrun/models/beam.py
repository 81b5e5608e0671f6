"""Beam (Reflection's reflection/Beam-1.0-501B-A23B, HF `beam`): Qwen3-MoE's attention
(an RMSNorm on each query and key head) with each head's output gated by a sigmoid of
gate_proj(x) plus a per-head gate_bias, in sliding-window and full layers (`layer_types`;
by default every sixth layer and the last are full). Each layer type turns by its own RoPE
(`rope_parameters` per layer type) or, where it has none (the full layers by default), by
no RoPE: its queries are then scaled by (1 + (position + 1) / 2048) ** 0.1. OLMo 3's norms
(after attention and after the feed-forward, before each too) and residuals that keep the
stream's scale: the n-th addition (2 (layer + 1) for attention, one more for the
feed-forward) is out / sqrt(n) + residual * sqrt((n - 1) / n). The feed-forward is a dense
SwiGLU in the layers `mlp_layer_types` calls dense (the first three by default), else
experts chosen as DeepSeek-V3's are (sigmoid scores plus e_score_correction_bias, within
the topk_group best of n_group groups, renormalized with norm_topk_prob), their sum times
routed_scaling_factor; no shared expert. Logits are soft-capped (final_logit_softcapping).

Reference: transformers/models/beam/modular_beam.py.
"""

from __future__ import annotations

import math
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
    GatedMLP,
    LayerTypes,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    check_layer_types,
    mix_experts,
    rope_parameters,
    route_grouped,
    sliding_windows,
)
from llmrun.models.cache import KVCache
from llmrun.models.qwen3_moe import MLP

DEFAULT_THETA = 10000.0  # BeamConfig's (PreTrainedConfig's default_theta)
FULL_EVERY = 6  # BeamConfig's default: every sixth layer full, and the last
DENSE_LAYERS = 3  # BeamConfig's default: the first three layers dense
MLP_TYPES = ("dense", "sparse")
NOPE_SCALE_LENGTH, NOPE_SCALE_POWER = 2048, 0.1  # the scaled softmax of layers without RoPE


def default_layer_types(layers: int) -> list[str]:
    """BeamConfig's layer_types where a config lists none."""
    kinds = [
        "sliding_attention" if (i + 1) % FULL_EVERY else "full_attention" for i in range(layers)
    ]
    kinds[-1] = "full_attention"
    return kinds


@dataclass
class ModelArgs:
    # BeamConfig's defaults.
    hidden_size: int = 5120
    intermediate_size: int = 20480
    num_hidden_layers: int = 52
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    max_position_embeddings: int = 8192
    sliding_window: int | None = 512
    moe_intermediate_size: int = 2560
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    final_logit_softcapping: float | None = 30.0
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # Each layer type's RoPE settings, None for a type without RoPE.
    rope_by_type: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.attention_bias:
            raise UnsupportedError("Beam with attention_bias=true is not supported")
        self.layer_types = check_layer_types(
            self.layer_types or default_layer_types(layers), layers
        )
        if self.mlp_layer_types is None:
            dense = min(DENSE_LAYERS, layers)
            self.mlp_layer_types = ["dense"] * dense + ["sparse"] * (layers - dense)
        if len(self.mlp_layer_types) != layers or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types must list {layers} of {', '.join(MLP_TYPES)}, "
                f"not {self.mlp_layer_types!r}"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelFormatError("sliding_attention layers need a sliding_window")
        if "sparse" in self.mlp_layer_types:
            if not 0 < self.topk_group <= self.n_group or self.num_experts % self.n_group:
                raise ModelFormatError(
                    f"{self.num_experts} experts in n_group {self.n_group} groups, of which "
                    f"topk_group {self.topk_group} are kept, is not a routing"
                )
            if self.n_group > 1 and self.num_experts // self.n_group < 2:
                raise UnsupportedError("Beam groups of one expert are not supported")
            reachable = self.num_experts // self.n_group * self.topk_group
            if not 0 < self.num_experts_per_tok <= reachable:
                raise ModelFormatError(
                    f"num_experts_per_tok is {self.num_experts_per_tok}, but a token can reach "
                    f"{reachable} experts"
                )

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full layers."""
        return sliding_windows(self.layer_types, self.sliding_window)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        nested = config.get("rope_parameters")
        if nested is None:
            nested = {"sliding_attention": {"rope_type": "default"}, "full_attention": None}
        if not isinstance(nested, dict) or not set(nested) <= set(LAYER_TYPES):
            raise UnsupportedError(
                f"Beam's rope_parameters must be keyed by layer type ({', '.join(LAYER_TYPES)}), "
                f"not {nested!r}"
            )
        args = args_from_config(cls, {k: v for k, v in config.items() if k != "rope_parameters"})
        args.rope_by_type = rope_by_layer_type(config, nested, DEFAULT_THETA)
        args.rope_parameters = either_rope(args.rope_by_type, DEFAULT_THETA)
        return args


def rope_by_layer_type(
    config: dict[str, Any], nested: dict[str, Any], default_theta: float
) -> dict[str, dict[str, Any] | None]:
    """Each layer type's RoPE settings from `nested` (rope_parameters keyed by layer
    type; None or absent: no RoPE), rope_theta default_theta where one gives none."""
    return {
        kind: None
        if nested.get(kind) is None
        else rope_parameters(
            {**config, "rope_parameters": {"rope_theta": default_theta, **nested[kind]}}
        )
        for kind in LAYER_TYPES
    }


def either_rope(by_type: dict[str, dict[str, Any] | None], default_theta: float) -> dict[str, Any]:
    """RoPE settings for the model's tables: the full layers', else the sliding ones'
    (or, where no layer turns, unused defaults)."""
    return (
        by_type["full_attention"]
        or by_type["sliding_attention"]
        or rope_parameters({"rope_theta": default_theta})
    )


def nope_query_scale(positions: torch.Tensor) -> torch.Tensor:
    """The query factor [B, 1, T, 1] of layers without RoPE at positions [B, T]."""
    steps = (positions.float() + 1) / NOPE_SCALE_LENGTH
    return torch.exp(NOPE_SCALE_POWER * torch.log1p(steps))[:, None, :, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.layer_type = layer, args.layer_types[layer]
        self.rotates = args.rope_by_type[self.layer_type] is not None
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.gate_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.gate_bias = nn.Parameter(torch.zeros(self.n_heads))

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        heads = (batch, tokens, -1, self.head_dim)
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(heads)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(heads)).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        if self.rotates:
            q, k = frame.rotate(q), frame.rotate(k)
        else:
            q = (q.float() * nope_query_scale(frame.positions)).to(q.dtype)
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale)
        # each head's output times sigmoid(gate + its bias): [B, T, H, D]
        gate = self.gate_proj(x).view(heads) + self.gate_bias[:, None]
        out = out.view(heads) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, tokens, -1))


class Router(nn.Module):
    """Sigmoid scores in f32; the top k by score + e_score_correction_bias within the
    topk_group best groups (each scored by its best two), weighing their scores,
    renormalized with norm_topk_prob, times routed_scaling_factor."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, top_k] in x's dtype and expert indices [N, top_k]."""
        a = self.args
        weights, indices = route_grouped(
            F.linear(x.float(), self.weight.float()),
            a.num_experts_per_tok,
            scoring="sigmoid",
            bias=self.e_score_correction_bias.float(),
            n_group=a.n_group,
            topk_group=a.topk_group,
            group_score="top2",
            normalize=a.norm_topk_prob,
            scale=a.routed_scaling_factor,
        )
        return weights.to(x.dtype), indices


class MoE(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = Router(args)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.gate(x2)
        return mix_experts(x2, weights, indices, self.experts).view(x.shape)


def scaled_residual(out: torch.Tensor, residual: torch.Tensor, n: int) -> torch.Tensor:
    """The n-th addition to the residual stream, keeping its scale. The stream is then the
    plain sum's over sqrt(n), and every reader normalizes it: this changes the logits by
    the norms' eps alone, but keeps a half-precision stream in range."""
    return out * (1.0 / math.sqrt(n)) + residual * math.sqrt((n - 1) / n)


class DecoderLayer(nn.Module):
    """Norms before and after each sublayer; scaled residual additions."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = MoE(args) if args.mlp_layer_types[layer] == "sparse" else mlp(args)
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.additions = 2 * (layer + 1)

    def forward(self, x: torch.Tensor, frames: Any, cache: KVCache | None) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), frames, cache))
        x = scaled_residual(h, x, self.additions)
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return scaled_residual(h, x, self.additions + 1)


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, DecoderLayer)
        local = args.rope_by_type["sliding_attention"] or args.rope_parameters
        self.model.rotary_emb_local = RotaryEmbedding(
            local, args.head_dim, args.max_position_embeddings
        )

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """CausalLM.forward's logits, soft-capped: cap * tanh(logits / cap)."""
        logits = super().forward(*args, **kwargs)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
