"""AFMoE (Arcee Trinity Nano, Mini and Large; llama.cpp's "afmoe" GGUFs): sliding-window
layers that rotate mixed with global layers without any position encoding (three local
to each global by default), an RMSNorm over each query and key head, attention outputs
gated by sigmoid(gate_proj(x)) before o_proj, a norm before and after each sublayer
(x + post(sublayer(pre(x)))), num_dense_layers dense feed-forwards first and then
experts: each token's top k by score + expert_bias, weighted by the unbiased scores
(sigmoid, or Arcee's softmax where score_func says so), renormalized with route_norm,
times route_scale, plus a shared expert as wide as num_shared_experts experts. With
mup_enabled the embeddings are scaled by sqrt(hidden_size). Grouped routing (n_group
above 1) is refused.

transformers' router always takes sigmoid scores and renormalizes them; Arcee's own
config.json also carries score_func and route_norm (read by its original code and by
llama.cpp's converter), which llmrun honors.

Reference: transformers/models/afmoe/modeling_afmoe.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    LayerTypes,
    RMSNorm,
    args_from_config,
    attend_scaled,
    check_layer_types,
    check_top_k,
    mix_experts,
    route_grouped,
    sliding_windows,
)
from llmrun.models.cache import KVCache
from llmrun.models.qwen3_moe import MLP

SCORE_FUNCS = ("sigmoid", "softmax")


@dataclass
class ModelArgs:
    # AfmoeConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 6144  # the dense layers'
    moe_intermediate_size: int = 1408
    num_dense_layers: int = 1
    num_key_value_heads: int | None = None
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 16384
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_experts: int = 64
    num_experts_per_tok: int = 6
    num_shared_experts: int = 2
    route_scale: float = 1.0
    global_attn_every_n_layers: int = 4
    sliding_window: int | None = 1024
    layer_types: list[str] | None = None
    mup_enabled: bool = False
    attention_bias: bool = False
    # Arcee's config fields that transformers does not read.
    score_func: str = "sigmoid"
    route_norm: bool = True
    n_group: int = 1
    topk_group: int = 1
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.layer_types is None:
            every = self.global_attn_every_n_layers
            self.layer_types = [
                "sliding_attention" if (i + 1) % every else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.attention_bias:
            raise UnsupportedError("AFMoE with attention_bias=true is not supported")
        if self.score_func not in SCORE_FUNCS:
            raise UnsupportedError(
                f"AFMoE score_func {self.score_func!r} is not supported "
                f"(supported: {', '.join(SCORE_FUNCS)})"
            )
        if self.n_group > 1:
            raise UnsupportedError(
                f"AFMoE with grouped expert routing (n_group {self.n_group}) is not supported"
            )
        check_top_k(self.num_experts_per_tok, self.num_experts)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # sliding_window: null is no window (every layer attends to all earlier positions).
        return args_from_config(cls, config, nullable=("sliding_window",))

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return layer >= self.num_dense_layers

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(nn.Module):
    """Per-head q/k norms, RoPE on the sliding layers only, and the output gate."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.layer_type = args.layer_types[layer]
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        self.gate_proj = nn.Linear(args.hidden_size, q_width, bias=False)
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
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.layer_type == "sliding_attention":
            q, k = frame.rotate(q), frame.rotate(k)
        # attend_scaled: the sliding layers' cache may keep only their window (frame.plan).
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(x)))


class Router(nn.Module):
    """Each token's experts and their weights, from logits taken to f32."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, top_k] in x's dtype and expert indices [N, top_k]."""
        a = self.args
        weights, indices = route_grouped(
            self.gate(x).float(),
            a.num_experts_per_tok,
            scoring=a.score_func,
            bias=bias.float(),
            normalize=a.route_norm,
            scale=a.route_scale,
        )
        return weights.to(x.dtype), indices


class MoE(nn.Module):
    """Routed experts plus the shared expert every token goes through."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = Router(args)
        self.expert_bias = nn.Parameter(torch.zeros(args.num_experts))
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        shared = args.num_shared_experts
        self.shared_experts = MLP(args, args.moe_intermediate_size * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.router(x2, self.expert_bias)
        out = mix_experts(x2, weights, indices, self.experts).view(x.shape)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class Layer(nn.Module):
    """x + post_attention_norm(attn(input_norm(x))), then
    x + post_mlp_norm(mlp(pre_mlp_norm(x))): dense in the first layers, else experts."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = attention(args, layer)
        self.mlp = MoE(args) if args.sparse(layer) else mlp(args, args.intermediate_size)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_mlp_layernorm = RMSNorm(dim, eps)
        self.post_mlp_layernorm = RMSNorm(dim, eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), frames, cache)
        )
        return x + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x)))


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, Layer)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * self.args.hidden_size**0.5 if self.args.mup_enabled else x
