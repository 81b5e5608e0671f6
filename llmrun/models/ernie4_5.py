"""ERNIE 4.5 dense (Baidu ERNIE-4.5-0.3B; llama.cpp's "ernie4_5" GGUFs): Llama with RoPE
on adjacent pairs of each head, one `use_bias` for every projection, and its own
defaults (head_dim 128, RoPE base 500000, tied embeddings).

Reference: transformers/models/ernie4_5/modeling_ernie4_5.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config, rotate_pairs

# Ernie4_5Config's defaults where they differ from Llama's.
HEAD_DIM = 128
ROPE_THETA = 500000.0


@dataclass
class ModelArgs(llama.ModelArgs):
    head_dim: int | None = HEAD_DIM
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    use_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.attention_bias = self.mlp_bias = self.use_bias

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "rope_theta" not in config and "rope_theta" not in params:
            config = {**config, "rope_theta": ROPE_THETA}
        args = args_from_config(cls, config)
        if "head_dim" in config and config["head_dim"] is None:
            # An explicit null is hidden / heads (a missing head_dim is 128).
            args.head_dim = args.hidden_size // args.num_attention_heads
        return args


class Attention(llama.Attention):
    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return rotate_pairs(x, frame)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
