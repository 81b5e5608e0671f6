"""Ergo (Amazon's Amazon-FMR/Ergo, HF `ergo`): grouped-query attention from one fused
qkv_proj (query heads, then key heads, then value heads), an RMSNorm on each query and
key head, in sliding-window and full layers (`layer_types`; by default every
global_attention_every_n_layers-th is full). Each layer type turns by its own RoPE, on
adjacent pairs, or by none (the full layers by default); the full layers' scores are
multiplied by global_attention_scale where a config sets it. Norms before and after each
sublayer (OLMo 3's), each sublayer joining the residual stream through a learned gate per
feature: sigmoid(w) * out + sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2) * residual. The
feed-forward is a squared-ReLU MLP (no gate) in the first num_dense_blocks layers
(`mlp_layer_types`), else experts: sigmoid scores, the top num_experts_per_tok by score +
e_score_correction_bias, renormalized and times moe_routed_scaling_factor, each expert a
squared-ReLU MLP followed by an RMSNorm of its own, plus a shared expert (the same, its
norm too) every token goes through.

Reference: transformers/models/ergo/modular_ergo.py. The Hub's checkpoints keep their
training framework's names; llmrun/loading/ergo.py renames them to these.
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
    LayerTypes,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    check_layer_types,
    check_top_k,
    mix_experts,
    rotate_pairs,
    route_grouped,
    sliding_windows,
)
from llmrun.models.beam import either_rope, rope_by_layer_type
from llmrun.models.cache import KVCache

DEFAULT_THETA = 1_000_000.0  # ErgoConfig's
MLP_TYPES = ("dense", "sparse")


@dataclass
class ModelArgs:
    # ErgoConfig's defaults.
    vocab_size: int = 262144
    hidden_size: int = 8192
    num_hidden_layers: int = 64
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    first_dense_intermediate_size: int = 32768
    num_dense_blocks: int = 1
    moe_intermediate_size: int = 4096
    shared_intermediate_size: int = 8192
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_routed_scaling_factor: float = 8**0.5
    max_position_embeddings: int = 524288
    rms_norm_eps: float = 1e-12
    sliding_window: int = 512
    global_attention_every_n_layers: int = 4
    global_attention_scale: float | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # Each layer type's RoPE settings, None for a type without RoPE.
    rope_by_type: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        every = self.global_attention_every_n_layers
        if not self.layer_types and not (isinstance(every, int) and every > 0):
            raise ModelFormatError(
                f"global_attention_every_n_layers is {every!r}, not a positive whole number"
            )
        self.layer_types = check_layer_types(
            self.layer_types
            or [
                "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
            ],
            layers,
        )
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [
                "dense" if i < self.num_dense_blocks else "sparse" for i in range(layers)
            ]
        if len(self.mlp_layer_types) != layers or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types must list {layers} of {', '.join(MLP_TYPES)}, "
                f"not {self.mlp_layer_types!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"a hidden size of {self.hidden_size} does not split into "
                f"{self.num_attention_heads} heads"
            )
        check_top_k(self.num_experts_per_tok, self.num_experts)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full layers."""
        return sliding_windows(self.layer_types, self.sliding_window)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "sliding_window" not in config and "local_attention_window" in config:
            config = {**config, "sliding_window": config["local_attention_window"]}
        rope = config.get("rope_parameters")
        if not isinstance(rope, dict) or not set(rope) <= set(LAYER_TYPES):
            # A flat one (or the older top-level rope_theta) is the sliding layers'.
            flat = rope if isinstance(rope, dict) else config.get("rope_scaling") or {}
            theta = config.get("rope_theta", DEFAULT_THETA)
            rope = {"sliding_attention": {"rope_theta": theta, **flat}, "full_attention": None}
        flat_config = {
            k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")
        }
        args = args_from_config(cls, flat_config)
        args.rope_by_type = rope_by_layer_type(flat_config, rope, DEFAULT_THETA)
        args.rope_parameters = either_rope(args.rope_by_type, DEFAULT_THETA)
        if "partial_rotary_factor" in args.rope_parameters:
            raise UnsupportedError("Ergo with partial_rotary_factor is not supported")
        return args


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.layer_type = layer, args.layer_types[layer]
        self.rotates = args.rope_by_type[self.layer_type] is not None
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        if self.layer_type == "full_attention" and args.global_attention_scale is not None:
            self.scale *= args.global_attention_scale
        qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, (H + 2 Hkv) * D] -> [B, T, H + 2 Hkv, D]: query heads, key heads, value heads
        qkv = self.qkv_proj(x).view(batch, tokens, -1, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        # -> [B, H, T, D], queries and keys normalized per head
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        if self.rotates:
            q, k = rotate_pairs(q, frame), rotate_pairs(k, frame)
        return self.o_proj(attend_scaled(q, k, v, self.layer, frame, cache, self.scale))


class MLP(nn.Module):
    """down(relu(up(x))^2): the leading dense layers' feed-forward."""

    def __init__(self, args: ModelArgs, width: int | None = None) -> None:
        super().__init__()
        width = width or args.first_dense_intermediate_size
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class Expert(MLP):
    """A routed or the shared expert: the squared-ReLU MLP, then its own RMSNorm."""

    def __init__(self, args: ModelArgs, width: int) -> None:
        super().__init__(args, width)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class Router(nn.Module):
    """Sigmoid scores in f32; the top k by score + e_score_correction_bias, weighing their
    scores renormalized, times moe_routed_scaling_factor."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.linear = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.linear.read_as_floats = True  # its f32 product is the router's own
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, top_k] in x's dtype and expert indices [N, top_k]."""
        weights, indices = route_grouped(
            F.linear(x.float(), self.linear.weight.float()),
            self.args.num_experts_per_tok,
            scoring="sigmoid",
            bias=self.e_score_correction_bias.float(),
            normalize=True,
            scale=self.args.moe_routed_scaling_factor,
        )
        return weights.to(x.dtype), indices


class MoE(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = Router(args)
        self.experts = nn.ModuleList(
            Expert(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        self.shared_experts = Expert(args, args.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.gate(x2)
        routed = mix_experts(x2, weights, indices, self.experts).view(x.shape)
        return routed + self.shared_experts(x)


class ResidualGate(nn.Module):
    """A sublayer's output joining the residual stream, mixed by a learned weight per
    feature (in f32)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.hidden_size))

    def forward(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        gate = torch.sigmoid(w)
        kept = torch.sqrt(1.0 + gate) * torch.exp(-0.5 * F.softplus(w))
        return (gate * out + kept * residual).to(residual.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = MoE(args) if args.mlp_layer_types[layer] == "sparse" else mlp(args)
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.attention_residual_gate = ResidualGate(args)
        self.feedforward_residual_gate = ResidualGate(args)

    def forward(self, x: torch.Tensor, frames: Any, cache: KVCache | None) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), frames, cache))
        x = self.attention_residual_gate(h, x)
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.feedforward_residual_gate(h, x)


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer)
        local = args.rope_by_type["sliding_attention"] or args.rope_parameters
        self.model.rotary_emb_local = RotaryEmbedding(
            local, args.head_dim, args.max_position_embeddings
        )
