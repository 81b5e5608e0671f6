"""Apertus (Swiss AI, 8B and 70B): Llama with an RMSNorm on each query and key head
before RoPE (Qwen3's), a feed-forward without a gate, down(xIELU(up(x))), whose xIELU
activation has learned parameters of its own in each layer, and its norms named
attention_layernorm and feedforward_layernorm. A config without RoPE settings takes
Apertus's Llama 3 scaling (ApertusConfig's default).

Apertus 1.5 (apertus1p5_text, or the language model of an apertus1p5 checkpoint) is the
same model over a vocabulary extended with image and audio codes, its output head often
pruned to the first output_vocab_size ids: the ids past it, which the model cannot
emit, get logits of -inf, so the logits keep the vocabulary's width.

Reference: transformers/models/apertus/modeling_apertus.py, and XIELUActivation in
transformers/activations.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
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
    output_vocab_size: int | None = None  # Apertus 1.5's pruned head: its rows

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output_vocab_size == self.vocab_size:
            self.output_vocab_size = None
        if self.output_vocab_size is not None:
            if not 1 <= self.output_vocab_size < self.vocab_size:
                raise ModelFormatError(
                    f"output_vocab_size ({self.output_vocab_size}) must be in [1, vocab_size] "
                    f"(vocab_size is {self.vocab_size})"
                )
            if self.tie_word_embeddings:
                raise UnsupportedError(
                    "an output head pruned to output_vocab_size rows tied to the embeddings "
                    "is not supported"
                )

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
        if args.output_vocab_size is not None:
            self.lm_head = nn.Linear(args.hidden_size, args.output_vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """CausalLM.forward's logits, those of the ids a pruned head lacks -inf."""
        logits = super().forward(input_ids, positions, cache, last_only, last, static, images)
        missing = self.args.vocab_size - logits.shape[-1]
        return F.pad(logits, (0, missing), value=float("-inf")) if missing > 0 else logits
