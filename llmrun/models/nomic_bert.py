"""Nomic BERT (NomicBertModel: nomic-embed-text v1 and v1.5; llama.cpp's "nomic-bert"
GGUFs): a BERT-style encoder with rotary positions instead of a position table, a SwiGLU
feed-forward and no biases but the LayerNorms': token and token-type (0) embeddings
summed and normalized, then post-norm blocks x = LN(x + attn(x)), x = LN(x + mlp(x)), the
attention bidirectional over the unpadded keys, its queries and keys turned by RoPE (half-
split, over whole heads). No final norm and no head: an embedding model (`hidden_states`).

Module names are transformers 5's (layers.N.self_attn.q_proj, mlp.gate_proj,
post_attention_layernorm, post_mlp_layernorm); the Hub's original names (emb_ln,
encoder.layers.N.attn.Wqkv, mlp.fc11/fc12/fc2, norm1/norm2) and config fields (n_embd,
rotary_emb_base, ...) are mapped at the loader edge (llmrun/loading/nomic_bert.py).

Reference: transformers/models/nomic_bert/modeling_nomic_bert.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.models.base import GatedMLP, RotaryEmbedding, rope_parameters
from llmrun.models.bert import encoder_attention, key_padding_mask

# NomicBertConfig's default_theta: the RoPE base of a config that names none.
DEFAULT_ROPE_THETA = 1000.0


@dataclass
class ModelArgs:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    vocab_size: int = 30528
    head_dim: int | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        has_theta = "rope_theta" in config or "rope_theta" in (config.get("rope_parameters") or {})
        theta = {} if has_theta else {"rope_theta": DEFAULT_ROPE_THETA}
        values["rope_parameters"] = rope_parameters({**theta, **config})
        return cls(**values)


class Embeddings(nn.Module):
    """LayerNorm(word + token type 0): no position table (nomic-bert's RoPE, jina-bert-v2's
    ALiBi place the tokens in the attention)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Type 0's row by lookup: the loader may hold the table as f16 blocks.
        types = self.token_type_embeddings(torch.zeros_like(input_ids[:, :1]))
        return self.LayerNorm(self.word_embeddings(input_ids) + types)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        width = self.n_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, args.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            # [B, T, H * D] -> [B, H, T, D]
            return t.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)

        cos, sin = rope
        q = ops.rotary(heads(self.q_proj(x)), cos, sin)
        k = ops.rotary(heads(self.k_proj(x)), cos, sin)
        return self.o_proj(encoder_attention(q, k, heads(self.v_proj(x)), mask))


class Layer(nn.Module):
    """x = LN(x + attn(x)), then LN(x + mlp(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.mlp = GatedMLP(args)
        self.post_mlp_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = self.post_attention_layernorm(x + self.self_attn(x, mask, rope))
        return self.post_mlp_layernorm(x + self.mlp(x))


class Model(nn.Module):
    """The encoder under NomicBertModel's module names (embeddings., layers.N.)."""

    generates = False  # no LM head: an embedding model (llmrun embed)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Float32 last hidden states [B, T, hidden] of input_ids [B, T] at positions
        [B, T], each row's first lengths[b] tokens real (padding after them is never
        attended to)."""
        x = self.embeddings(input_ids)
        mask = key_padding_mask(lengths, input_ids.shape[1])
        cos, sin = self.rotary_emb(positions)
        # [B, T, D] -> [B, 1, T, D], broadcast over heads
        rope = (cos[:, None].to(x.dtype), sin[:, None].to(x.dtype))
        for layer in self.layers:
            x = layer(x, mask, rope)
        return x.float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings contract's name for forward()."""
        return self(input_ids, positions, lengths)
