"""Seed-OSS (ByteDance Seed-OSS-36B; llama.cpp's "seed_oss" GGUFs): Llama with biases
on the query, key and value projections (attention_bias, on by default) apart from the
output projection's (attention_out_bias, off by default), and heads of 128 whatever
the hidden size. Its residual and attention dropouts act in training only.

Reference: transformers/models/seed_oss/modeling_seed_oss.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from llmrun.models import llama
from llmrun.models.base import CausalLM, GatedMLP, args_from_config


@dataclass
class ModelArgs(llama.ModelArgs):
    head_dim: int | None = 128
    attention_bias: bool = True
    attention_out_bias: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # An explicit null head_dim is hidden_size / heads (SeedOssConfig), not 128.
        return args_from_config(cls, config, nullable=("head_dim",))


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.o_proj = nn.Linear(
            self.n_heads * self.head_dim, args.hidden_size, bias=args.attention_out_bias
        )


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
