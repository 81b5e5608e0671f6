"""Orion (OrionStarAI/Orion-14B): StableLM's layers with whole-head RoPE. Llama's SwiGLU
feed-forward and attention without biases, but LayerNorms (weight and bias) for every
norm, whose epsilon OrionConfig calls rms_norm_eps.

Reference: the Hub's modeling_orion.py (remote code; vLLM's models/orion.py reads it the
same way) and llama.cpp's src/models/orion.cpp. Parameter names are the Hub's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import stablelm
from llmrun.models.base import args_from_config


@dataclass
class ModelArgs(stablelm.ModelArgs):
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        self.layer_norm_eps = self.rms_norm_eps  # a LayerNorm's, whatever its name says
        self.rope_parameters.setdefault("partial_rotary_factor", 1.0)
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


Model = stablelm.Model
