"""GLM-4 0414 (GLM-4-9B/32B-0414, GLM-Z1; llama.cpp's "glm4" GGUFs): Llama's attention
with q/k/v biases, RoPE on adjacent pairs of the first half of each head
(partial_rotary_factor, 0.5 where a config leaves it out), a fused gate_up MLP, and
four norms a layer: after attention and after the MLP as well as before each; also the
language model of GLM-4.1V, whose prompts with images turn by M-RoPE (llmrun.models.mrope;
rope_parameters' mrope_section, in blocks over the rotated adjacent pairs).

Reference: transformers/models/glm4/modeling_glm4.py, models/glm4v/modeling_glm4v.py
(Glm4vTextRotaryEmbedding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models import base, llama, mrope
from llmrun.models.base import Frame, RMSNorm, args_from_config, rotate_pairs
from llmrun.models.cache import KVCache
from llmrun.models.phi3 import MLP

PARTIAL_ROTARY_FACTOR = 0.5  # Glm4Config's default


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1.5625e-7
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        args = args_from_config(cls, config)
        args.rope_parameters.setdefault("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
        return args


class Attention(llama.Attention):
    """Llama's attention with biases on q, k and v only, rotating adjacent pairs."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return rotate_pairs(x, frame)


class DecoderLayer(base.DecoderLayer):
    """x + post_self_attn_norm(attn(norm(x))), then
    x + post_mlp_norm(mlp(post_attention_norm(x)))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.post_self_attn_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), frame, cache))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Model(mrope.MRopeLM):
    # rotate_pairs gathers pair i into features i and i + rotary_dim / 2, so the
    # sections' blocks of pairs are Glm4vTextRotaryEmbedding's.
    interleaved = False

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer)
