"""MiniCPM3 (openbmb/MiniCPM3-4B; llama.cpp's "minicpm3" GGUFs): DeepSeek-V2's
multi-head latent attention (deepseek_v2.py; RoPE turning x[i] with x[i + rope / 2], not
adjacent pairs) and a dense SwiGLU feed-forward in every layer, with Granite's muP
scalars (granite.py) under MiniCPM's names: the embeddings times scale_emb, each
sublayer's output times scale_depth / sqrt(num_hidden_layers) before it joins the
residual stream, and the final hidden state divided by hidden_size / dim_model_base
before the output matrix. The norms inside attention take transformers' RMSNorm default
eps (1e-6); RoPE may be LongRoPE (MiniCPM3-4B's long and short factors).

Reference: transformers/models/minicpm3/modular_minicpm3.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import UnsupportedError
from llmrun.models import deepseek_v2, granite
from llmrun.models.base import Frame, args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(deepseek_v2.ModelArgs):
    # MiniCPM3Config's defaults; no experts (num_experts_per_tok is DeepSeek's field).
    num_experts_per_tok: int = 0
    intermediate_size: int = 6400
    kv_lora_rank: int = 256
    q_lora_rank: int | None = 768
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int | None = None  # hidden_size / num_attention_heads
    rope_interleave: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    scale_emb: float = 12.0
    scale_depth: float | None = 1.4  # None: sqrt(num_hidden_layers), no scaling
    dim_model_base: int | None = 256  # None: hidden_size, no scaling

    def __post_init__(self) -> None:
        # Dense layers throughout: none of DeepSeek's routing to check.
        if self.mlp_bias:
            raise UnsupportedError("MiniCPM3 with mlp_bias=true is not supported")
        if "partial_rotary_factor" in self.rope_parameters:
            raise UnsupportedError("MiniCPM3 with partial_rotary_factor is not supported")
        if self.v_head_dim is None:
            self.v_head_dim = self.hidden_size // self.num_attention_heads
        if self.scale_depth is None:
            self.scale_depth = math.sqrt(self.num_hidden_layers)
        if self.dim_model_base is None:
            self.dim_model_base = self.hidden_size

    def sparse(self, layer: int) -> bool:
        return False

    # granite.Model's names for the three scalars.
    @property
    def embedding_multiplier(self) -> float:
        return self.scale_emb

    @property
    def residual_multiplier(self) -> float:
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    @property
    def logits_scaling(self) -> float:
        return self.hidden_size / self.dim_model_base

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        nullable = ("q_lora_rank", "v_head_dim", "scale_depth", "dim_model_base")
        return args_from_config(cls, config, nullable=nullable)


class Attention(deepseek_v2.Attention):
    """Multi-head latent attention, its output scaled by the residual multiplier."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        return super().forward(x, frame, cache) * self.residual_multiplier


class Model(granite.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, granite.MLP, Attention)
