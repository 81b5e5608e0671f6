"""Code World Model (facebook/cwm, CwmForCausalLM): Llama whose layers each attend either
to every earlier position or to the last sliding_window of them, as `layer_types` says:
Ministral's model (ministral.py) with CwmConfig's defaults. Where a config lists no layer
types, every fourth layer (from the first) is full and the rest slide over 8192
positions; where it gives no RoPE settings, Llama 3's scaled RoPE of base 1e6. Its q/k/v
projections have no biases whatever `attention_bias` says (CwmConfig drops the field).

Reference: transformers/models/cwm/modular_cwm.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import ministral
from llmrun.models.base import args_from_config

WINDOW_PATTERN = 4  # CwmConfig: layers 0, 4, 8, ... full, the others sliding
DEFAULT_ROPE = dict(
    rope_type="llama3",
    rope_theta=1_000_000.0,
    factor=16.0,
    high_freq_factor=4.0,
    low_freq_factor=1.0,
    original_max_position_embeddings=8192,
)


@dataclass
class ModelArgs(ministral.ModelArgs):
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    sliding_window: int | None = 8192

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = {k: v for k, v in config.items() if k != "attention_bias"}
        if config.get("layer_types") is None and "num_hidden_layers" in config:
            config["layer_types"] = [
                "sliding_attention" if i % WINDOW_PATTERN else "full_attention"
                for i in range(config["num_hidden_layers"])
            ]
        # CwmConfig fills its RoPE default before it reads a top-level rope_theta, which
        # then counts only beside rope_scaling.
        if not config.get("rope_parameters") and not config.get("rope_scaling"):
            config["rope_parameters"] = dict(DEFAULT_ROPE)
        # A null window is no window: its sliding layers are then refused, as CwmConfig
        # refuses it, rather than given the default.
        return args_from_config(cls, config, nullable=("sliding_window",))


# Ministral's model itself, so that llmrun.quant.decode_step knows it as "ministral".
Model = ministral.Model
