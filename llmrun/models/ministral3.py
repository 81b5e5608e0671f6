"""Ministral 3 (3B, 8B, 14B; llama.cpp's "mistral3" GGUFs): Mistral with YaRN RoPE and
Llama 4's attention temperature, which scales the queries at position p by
1 + beta * log(1 + floor(p / original context)), so 1 within the original context.

Reference: transformers/models/ministral3/modeling_ministral3.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config, query_temperature


@dataclass
class ModelArgs(llama.ModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def temperature(self) -> tuple[float, int]:
        """Llama 4's scaling: beta (0: none) and the context its steps are counted in."""
        params = self.rope_parameters
        beta = params.get("llama_4_scaling_beta") or 0.0
        return beta, params.get("original_max_position_embeddings") or self.max_position_embeddings


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.beta, self.original = args.temperature

    def scale_queries(self, q: torch.Tensor, frame: Frame) -> torch.Tensor:
        if not self.beta:
            return q
        return q * query_temperature(frame.positions, self.beta, self.original).to(q.dtype)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
        beta, original = args.temperature
        # The native decode step has no query temperature: it takes the positions where
        # the temperature is 1.
        self.step_positions = original if beta else None
