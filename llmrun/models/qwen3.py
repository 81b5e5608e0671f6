"""Qwen3 (dense): Llama with an RMSNorm on each query and key head before RoPE; also the
language model of Qwen3-VL, whose prompts with images turn by interleaved M-RoPE and take
the images' deepstack features (llmrun.models.mrope; rope_parameters' mrope_section).

Reference: transformers/models/qwen3/modeling_qwen3.py,
models/qwen3_vl/modeling_qwen3_vl.py (Qwen3VLTextModel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import mrope
from llmrun.models.base import Frame, GatedMLP, RMSNorm, args_from_config, attend
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_sliding_window:
            raise UnsupportedError("Qwen3 with use_sliding_window=true is not supported")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

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
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)).transpose(
            1, 2
        )
        k = self.k_norm(
            self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        ).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(self.attend(q, k, v, frame, cache))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        """The rotated queries' attention [B, T, H*D] over the cache with k/v added
        (Mellum's sliding layers keep only their window)."""
        return attend(q, k, v, self.layer, frame, cache)


class Model(mrope.MRopeLM):
    # Qwen3VLTextRotaryEmbedding interleaves the sections whatever the config says.
    interleaved = True

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
