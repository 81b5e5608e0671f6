"""Apertus (Swiss AI, 8B and 70B): Llama with an RMSNorm on each query and key head
before RoPE (Qwen3's), a feed-forward without a gate, down(xIELU(up(x))), whose xIELU
activation has learned parameters of its own in each layer, and its norms named
attention_layernorm and feedforward_layernorm. A config without RoPE settings takes
Apertus's Llama 3 scaling (ApertusConfig's default).

Reference: transformers/models/apertus/modeling_apertus.py, and XIELUActivation in
transformers/activations.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models import llama, qwen3
from llmrun.models.base import CausalLM, Frame, RMSNorm, activation, args_from_config
from llmrun.models.cache import KVCache

# ApertusConfig's RoPE where a config.json gives none.
DEFAULT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 12000000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
XIELU_ACT = "xielu"  # the hidden_act that names it


@dataclass
class ModelArgs(llama.ModelArgs):
    # ApertusConfig's defaults where they differ from Llama's.
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 65536
    hidden_act: str = XIELU_ACT

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if not any(k in config for k in ("rope_parameters", "rope_scaling", "rope_theta")):
            config = {**config, "rope_parameters": DEFAULT_ROPE}
        return args_from_config(cls, config)


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010) with a layer's learned parameters as checkpoints store
    them: alpha_p and alpha_n before their softplus, beta and eps as they are.
    x > 0: a_p x^2 + beta x; else (expm1(min(x, eps)) - x) a_n + beta x, where
    a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1))
        self.alpha_n = nn.Parameter(torch.zeros(1))
        self.beta = nn.Parameter(torch.zeros(()))
        self.eps = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


class MLP(nn.Module):
    """down(act(up(x))): no gate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act_fn = XIELU() if args.hidden_act == XIELU_ACT else activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class Layer(nn.Module):
    """The pre-norm block (base.DecoderLayer's) under Apertus's norm names."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.attention_layernorm(x), frame, cache)
        return x + self.mlp(self.feedforward_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, qwen3.Attention, MLP, Layer)
