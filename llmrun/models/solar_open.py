"""Upstage Solar Open (HF solar_open; llama.cpp converts it to a "glm4moe" GGUF):
GLM-4.5 MoE with experts in every layer, no q/k norms, and SolarOpenConfig's defaults:
RoPE on all of each head and a base of 1e6 where a config gives neither, heads of 128.

Reference: transformers/models/solar_open/modeling_solar_open.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import glm4_moe

ROPE_THETA = 1_000_000.0  # SolarOpenConfig's default_theta


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    moe_intermediate_size: int = 1280
    head_dim: int | None = 128

    default_partial_rotary_factor = 1.0

    def __post_init__(self) -> None:
        # Every layer is a mixture of experts, without q/k norms, whatever a config says.
        self.first_k_dense_replace, self.use_qk_norm = 0, False
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "rope_theta" not in params and "rope_theta" not in config:
            config = {**config, "rope_theta": ROPE_THETA}
        return super().from_config(config)


class Model(glm4_moe.Model):
    """GLM-4.5 MoE's model, under this family's name."""
