"""MiniMax-Text-01 (and MiniMax-M1): a hybrid of lightning attention (linear attention
with a per-head exponential decay, a state per sequence) and softmax attention layers,
each followed by a mixture of experts (Mixtral's: softmax top-k, renormalized). Each
block scales its residual: out = alpha * norm(x) + beta * sublayer(norm(x)), the
residual being the normed input (MiniMax's "post-norm" layout).

Reference: transformers/models/minimax/modeling_minimax.py. A lightning layer: q, k, v
= silu(qkv_proj(x)) per head; with decay l = exp(-slope) (the head's ALiBi slope
2^(-8 (h + 1) / heads), scaled by 1 - layer / (layers - 1) + 1e-5), the state S_t =
l S_(t-1) + k_t^T v_t and o_t = q_t S_t; then an RMSNorm over all heads (eps 1e-6,
transformers' and the original code's), a sigmoid gate output_gate(x), out_proj.
Prefill runs in blocks of block_size tokens (within a block, the decays of every
pair of tokens), as transformers does; each row's padded tokens neither decay nor add
to the state (their decay exponent is 0 and their keys zero). Parameter names are the
Hub's (block_sparse_moe.experts.N.w1, ...), as Mixtral's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import mixtral
from llmrun.models.base import (
    CausalLM,
    Frame,
    Hybrid,
    RMSNorm,
    activation,
    args_from_config,
    check_top_k,
)
from llmrun.models.cache import KVCache

LAYER_TYPES = ("full_attention", "linear_attention")
# transformers' MiniMaxLightningAttention.norm: MiniMaxRMSNorm's default epsilon
LIGHTNING_NORM_EPS = 1e-6


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096 * 32
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    layer_types: list[str] | None = None
    block_size: int = 256
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.layer_types is None:  # MiniMaxConfig's default: every other layer
            self.layer_types = [
                "full_attention" if (i + 1) % 2 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise UnsupportedError(
                    f"MiniMax layer type {kind!r} is not supported ({', '.join(LAYER_TYPES)} are)"
                )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {self.num_hidden_layers}"
            )
        if self.sliding_window is not None:
            raise UnsupportedError("MiniMax with a sliding window is not supported")
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def attention_layers(self) -> list[int]:
        """The softmax attention layers' indices; the KV cache holds these alone."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each lightning layer's state of one sequence: [heads, head_dim, head_dim]."""
        shape = (self.num_attention_heads, self.head_dim, self.head_dim)
        return {i: [shape] for i, kind in enumerate(self.layer_types) if kind != "full_attention"}

    def layer_windows(self) -> list[None]:
        """Each cached (softmax attention) layer's window: none."""
        return [None] * len(self.attention_layers)


def slopes(args: ModelArgs, layer: int) -> torch.Tensor:
    """The decay rates [heads] of a lightning layer, as transformers' get_slope_rate."""
    heads = args.num_attention_heads
    base = 1 / (2 ** (8 / heads))
    rate = base ** (torch.arange(heads, dtype=torch.float32, device="cpu") + 1)
    return rate * (1 - layer / (args.num_hidden_layers - 1 + 1e-5) + 1e-5)


class LightningAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        self.block_size = args.block_size
        width = self.heads * self.head_dim
        self.act = activation(args.hidden_act)
        self.qkv_proj = nn.Linear(args.hidden_size, 3 * width, bias=False)
        self.output_gate = nn.Linear(args.hidden_size, width, bias=False)
        self.out_proj = nn.Linear(width, args.hidden_size, bias=False)
        self.norm = RMSNorm(width, LIGHTNING_NORM_EPS)
        # not in any checkpoint: explicit CPU (the model is built on the meta device)
        self.register_buffer("slope", slopes(args, layer), persistent=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H * 3D] -> [B, T, H, 3D] -> [B, H, T, 3D]
        qkv = self.act(self.qkv_proj(x)).view(batch, tokens, self.heads, -1).transpose(1, 2)
        q, k, v = qkv.float().split(self.head_dim, dim=-1)
        # Each token's log decay [B, H, T]: -slope, but 0 for padded tokens, whose keys
        # are zeroed: the state after a row is the state after its real tokens.
        real = torch.ones(batch, tokens, device=x.device)
        if frame.counts is not None:
            real = torch.arange(tokens, device=x.device) < frame.counts[:, None].to(x.device)
            real = real.float()
            k = k * real[:, None, :, None]
        log_decay = -self.slope.to(x.device)[None, :, None] * real[:, None, :]
        recurrent = cache.recurrent if cache is not None else None
        if recurrent is not None:
            state = recurrent.read(self.layer)[0].float()
        else:
            state = x.new_zeros(
                batch, self.heads, self.head_dim, self.head_dim, dtype=torch.float32
            )
        out = []
        for start in range(0, tokens, self.block_size):
            span = slice(start, start + self.block_size)
            y, state = self.block(
                q[:, :, span], k[:, :, span], v[:, :, span], log_decay[:, :, span], state
            )
            out.append(y)
        if recurrent is not None:
            recurrent.write(self.layer, [state])
        # [B, H, T, D] -> [B, T, H * D]
        y = torch.cat(out, dim=2).transpose(1, 2).reshape(batch, tokens, -1).to(x.dtype)
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * self.norm(y))

    @staticmethod
    def block(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_decay: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block's outputs [B, H, n, D] and the state after it [B, H, D, D], for
        q/k/v [B, H, n, D], each token's log decay [B, H, n] and the state before it:
        o_i = q_i (d(0..i) S + sum_(j <= i) d(j+1..i) k_j^T v_j), d the decays' product."""
        total = log_decay.cumsum(dim=-1)  # [B, H, n]: log d(0..i)
        # log d(j+1..i) for j <= i, -inf above the diagonal: [B, H, n, n]
        pairs = total[..., :, None] - total[..., None, :]
        causal = torch.ones(pairs.shape[-2:], dtype=torch.bool, device=q.device).tril()
        weights = (q @ k.transpose(-1, -2)) * torch.where(causal, pairs, -torch.inf).exp()
        y = weights @ v + (q * total[..., None].exp()) @ state
        # the state after the block: d(0..n-1) S + sum_j d(j+1..n-1) k_j^T v_j
        last = total[..., -1:]
        state = (
            state * last[..., None].exp()
            + (k * (last - total)[..., None].exp()).transpose(-1, -2) @ v
        )
        return y, state


class Attention(mixtral.Attention):
    """Mixtral's attention, at its place among the KV cache's (softmax) layers."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.attention_layers.index(layer))


class DecoderLayer(nn.Module):
    """h = alpha * norm(x) + beta * attention(norm(x)), then the same with the experts;
    alpha and beta the layer type's (and the experts')."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        if args.layer_types[layer] == "full_attention":
            self.self_attn = attention(args, layer)
            self.attn_alpha = args.full_attn_alpha_factor
            self.attn_beta = args.full_attn_beta_factor
        else:
            self.self_attn = LightningAttention(args, layer)
            self.attn_alpha = args.linear_attn_alpha_factor
            self.attn_beta = args.linear_attn_beta_factor
        self.block_sparse_moe = mlp(args)
        self.mlp_alpha, self.mlp_beta = args.mlp_alpha_factor, args.mlp_beta_factor
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = self.input_layernorm(x)
        x = x * self.attn_alpha + self.self_attn(x, frame, cache) * self.attn_beta
        x = self.post_attention_layernorm(x)
        return x * self.mlp_alpha + self.block_sparse_moe(x) * self.mlp_beta


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, mixtral.SparseMoeBlock, DecoderLayer)
