"""EuroBERT encoders (EuroBertModel: EuroBERT/EuroBERT-210m, -610m, -2.1B; the backbone of
jina-embeddings-v5-text-nano; llama.cpp's "eurobert" GGUFs): Llama's layers as an encoder.
Pre-norm blocks x + attn(rms(x)), x + mlp(rms(x)), then a final RMSNorm; separate q/k/v
projections with grouped key/value heads, RoPE (half-split), every query attending to
every real key on both sides (padded keys masked); a SwiGLU feed-forward
down(act(gate(x)) * up(x)). No head: an embedding model (`hidden_states`).

Reference: transformers/models/eurobert/modeling_eurobert.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.models.base import GatedMLP, RMSNorm, RotaryEmbedding, args_from_config
from llmrun.models.bert import encoder_attention, key_padding_mask


@dataclass
class ModelArgs:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    vocab_size: int = 128256
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        bias, hidden = args.attention_bias, args.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H * D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:  # each key/value head serves `groups` consecutive query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.o_proj(encoder_attention(q, k, v, mask))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GatedMLP(args)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), mask, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    """The encoder under EuroBertModel's module names (embed_tokens, layers.N., norm)."""

    generates = False  # no LM head: an embedding model (llmrun embed)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Float32 last hidden states [B, T, hidden] (after the final norm) of input_ids
        [B, T] at positions [B, T], each row's first lengths[b] tokens real (padding after
        them is never attended to)."""
        x = self.embed_tokens(input_ids)
        mask = key_padding_mask(lengths, input_ids.shape[1])
        cos, sin = self.rotary_emb(positions)
        # [B, T, D] -> [B, 1, T, D], broadcast over heads
        rope = (cos[:, None].to(x.dtype), sin[:, None].to(x.dtype))
        for layer in self.layers:
            x = layer(x, mask, rope)
        return self.norm(x).float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings contract's name for forward()."""
        return self(input_ids, positions, lengths)
