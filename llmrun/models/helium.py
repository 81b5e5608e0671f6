"""Helium (Kyutai's kyutai/helium-1-preview-2b, helium-1-2b): Llama with RoPE on
adjacent pairs (x[2i], x[2i+1]) rather than halves, and an output projection without a
bias even where attention_bias puts one on the queries, keys and values.

Reference: transformers/models/helium/modeling_helium.py. llama.cpp has no converter
for it: HF folders only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config, rotate_pairs


@dataclass
class ModelArgs(llama.ModelArgs):
    rms_norm_eps: float = 1e-8
    head_dim: int | None = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        # transformers' o_proj is hidden x hidden: heads must fill the hidden size.
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ModelFormatError(
                f"Helium: {self.num_attention_heads} heads of {self.head_dim} do not make "
                f"the hidden size {self.hidden_size}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.o_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return rotate_pairs(x, frame)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
