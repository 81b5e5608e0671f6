"""StarCoder2 (3B, 7B, 15B; llama.cpp's "starcoder2" GGUFs): Llama's attention with
biased projections (use_bias) and a sliding window (Mistral's mask), LayerNorms with a
bias, and a feed-forward without a gate: c_proj(gelu(c_fc(x))).

Reference: transformers/models/starcoder2/modeling_starcoder2.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, activation, args_from_config
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
    norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096
    hidden_act: str = "gelu_pytorch_tanh"
    use_bias: bool = True
    tie_word_embeddings: bool = True
    sliding_window: int | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        # transformers turns whole heads by cos/sin of the partial width: no model to follow.
        partial = self.rope_parameters.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise UnsupportedError(
                f"a StarCoder2 model with partial RoPE (partial_rotary_factor {partial}) "
                "is not supported"
            )

    @property
    def attention_bias(self) -> bool:
        """use_bias under the name llama.Attention reads: q, k, v and o all biased or not."""
        return self.use_bias

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class MLP(nn.Module):
    """c_proj(act(c_fc(x))): no gate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.c_fc = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.use_bias)
        self.c_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.use_bias)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class DecoderLayer(nn.Module):
    """The pre-norm block, x + attn(ln(x)), then x + mlp(ln(x)), with LayerNorms."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, args.norm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.norm_epsilon)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.norm_epsilon)
        super().__init__(args, llama.Attention, MLP, DecoderLayer, norm)
