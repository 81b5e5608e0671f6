"""Gemma: Llama's layout with a GeGLU feed-forward (tanh GELU), RMSNorm as
x * (1 + w), the embedding scaled by sqrt(hidden_size), head_dim 256 and tied
embeddings. PaliGemma 1's language model (llmrun.paligemma_images) is one that takes an
image: its prompt seen both ways, as PaliGemma 2's (llmrun.models.paligemma).

Reference: transformers/models/gemma/modeling_gemma.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models.base import (
    Frame,
    GatedMLP,
    GemmaRMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    attention_mask,
    head_logits,
    key_positions,
    new_cache,
)
from llmrun.models.cache import KVCache
from llmrun.models.gemma3 import ImageTokens


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    hidden_act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.hidden_act == "gelu":
            # The released configs say "gelu" and mean the tanh approximation;
            # transformers' GemmaConfig makes the same substitution.
            self.hidden_act = "gelu_pytorch_tanh"

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
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend_scaled(q, k, v, self.layer, frame, cache, self.scale))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = GatedMLP(args)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class Model(nn.Module):
    """embed * sqrt(hidden) -> decoder layers -> norm -> lm_head, with HF's module names."""

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
        images: ImageTokens | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T];
        [B, 1, vocab] with last_only or `last` (as CausalLM.forward). `images`: PaliGemma
        1's prompt embeddings in place of its tokens, one group seen both ways (one row)."""
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        frame = self.frame(positions, cache, x.dtype)
        if images is not None:
            x = images.place(x)
            frame = images.unmask({"full_attention": frame}, None)["full_attention"]
        return head_logits(self, x, frame, cache, last_only, last).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, hidden] of input_ids [B, T], scaled by sqrt(hidden)
        rounded to the compute dtype, as transformers does (an image's are not scaled)."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.args.hidden_size**0.5).to(x.dtype)

    def frame(self, positions: torch.Tensor, cache: KVCache | None, dtype: torch.dtype) -> Frame:
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        mask = attention_mask(positions, key_positions(positions, length, cache))
        cos, sin = self.model.rotary_emb(positions)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        return Frame(positions, start, length, mask, cos[:, None].to(dtype), sin[:, None].to(dtype))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.args, batch, max_seq_len, dtype, device)
