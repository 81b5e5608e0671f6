"""Nemotron (NVIDIA Nemotron-Mini-4B, Minitron; llama.cpp's "nemotron" GGUFs): Llama's
attention with partial RoPE (half of each head by default) and biases where
attention_bias says, in pre-norm blocks whose norms are LayerNorm1P (a LayerNorm with a
bias, scaled by 1 + w), and a feed-forward without a gate, down(relu(up(x))^2).

Reference: transformers/models/nemotron/modeling_nemotron.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models import llama
from llmrun.models.base import CausalLM, DecoderLayer, activation, args_from_config

DEFAULT_PARTIAL_ROTARY = 0.5  # NemotronConfig's, where a config gives none
RELU2 = "relu2"


@dataclass
class ModelArgs(llama.ModelArgs):
    # NemotronConfig's defaults where they differ from Llama's.
    hidden_act: str = RELU2
    norm_eps: float = 1e-5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "partial_rotary_factor" not in config and "partial_rotary_factor" not in rope:
            config = {**config, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY}
        return args_from_config(cls, config)


class LayerNorm1P(nn.Module):
    """LayerNorm over the last dimension with a bias, scaled by 1 + w: checkpoints store w."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight + 1.0, self.bias, self.eps)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2, transformers' "relu2"."""
    return torch.square(F.relu(x))


class MLP(nn.Module):
    """down(act(up(x))), act relu(x)^2 unless hidden_act names another: no gate
    (Nemotron's and Arcee's feed-forward)."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        bias = args.mlp_bias
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=bias)
        self.act = relu_squared if args.hidden_act == RELU2 else activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class Layer(DecoderLayer):
    """base.DecoderLayer with LayerNorm1P for its two norms."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.input_layernorm = LayerNorm1P(args.hidden_size, args.norm_eps)
        self.post_attention_layernorm = LayerNorm1P(args.hidden_size, args.norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(
            args, llama.Attention, MLP, Layer, norm=LayerNorm1P(args.hidden_size, args.norm_eps)
        )
