"""Mixtral: Mistral with a sparse mixture-of-experts feed-forward, top-2 of 8 experts.

Reference: transformers/models/mixtral/modeling_mixtral.py. Parameter names are the
Hub's per-expert checkpoint keys (`block_sparse_moe.experts.N.w1`, ...), which
transformers 5 fuses into 3-D tensors when it loads them; llmrun keeps one module
per expert, so a loader can hand it any expert's weights as they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError
from llmrun.models.base import (
    Frame,
    RMSNorm,
    RotaryEmbedding,
    activation,
    args_from_config,
    attend,
    attention_mask,
    head_logits,
    key_positions,
    mix_experts,
    new_cache,
    route,
)
from llmrun.models.cache import KVCache


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
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ModelFormatError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, but there are "
                f"{self.num_local_experts} experts (num_local_experts)"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class Expert(nn.Module):
    """w2(act(w1(x)) * w3(x)): w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.gated(self.act, self.w1(x), self.w3(x)))


class SparseMoeBlock(nn.Module):
    """Each token through the top-k experts of its router's softmax, weighted by their
    renormalized probabilities."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = route(self.gate(x2), self.top_k, normalize=True)
        return mix_experts(x2, weights, indices, self.experts).view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.block_sparse_moe = SparseMoeBlock(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class Model(nn.Module):
    """embed -> decoder layers -> norm -> lm_head, with the Hub checkpoint's module names."""

    decode_step = None  # see llmrun.models.base.run_layers

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T];
        [B, 1, vocab] with last_only or `last` (as CausalLM.forward)."""
        body = self.model
        x = body.embed_tokens(input_ids)
        frame = self.frame(positions, cache, x.dtype)
        return head_logits(self, x, frame, cache, last_only, last).float()

    def frame(self, positions: torch.Tensor, cache: KVCache | None, dtype: torch.dtype) -> Frame:
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        mask = attention_mask(
            positions, key_positions(positions, length, cache), self.args.sliding_window
        )
        cos, sin = self.model.rotary_emb(positions)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        return Frame(positions, start, length, mask, cos[:, None].to(dtype), sin[:, None].to(dtype))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.args, batch, max_seq_len, dtype, device)
