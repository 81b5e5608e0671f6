"""OLMo 3 (AllenAI, 7B and 32B): OLMo 2 with sliding-window layers, three to each
global one by default, that rotate with plain RoPE, while the global layers take the
RoPE scaling (YaRN in the long-context checkpoints).

Reference: transformers/models/olmo3/modeling_olmo3.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llmrun.models import olmo2
from llmrun.models.base import (
    LAYER_TYPES,
    Frame,
    LayerTypes,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    rope_parameters,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache

# Olmo3Config's RoPE base, which its sliding layers take from a config in the older
# style (rope_theta and rope_scaling at the top level, both the global layers').
DEFAULT_THETA = 500000.0
GLOBAL_EVERY = 4  # transformers' default pattern: every fourth layer global


@dataclass
class ModelArgs(olmo2.ModelArgs):
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = windowed_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window, GLOBAL_EVERY
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        ropes = rope_by_layer_type(config)
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        args = args_from_config(cls, flat)
        args.rope_parameters = ropes["full_attention"]
        args.rope_local_parameters = ropes["sliding_attention"]
        return args

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


def rope_by_layer_type(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE settings of each layer type, as Olmo3Config reads them: transformers 5's
    `rope_parameters` {full_attention: {...}, sliding_attention: {...}}, or the older
    top-level rope_theta and rope_scaling, which are the global layers' (the sliding
    layers then rotate with DEFAULT_THETA, unscaled)."""
    nested = config.get("rope_parameters")
    if isinstance(nested, dict) and set(nested) & set(LAYER_TYPES):
        return {
            kind: rope_parameters(
                {
                    **config,
                    "rope_parameters": {
                        "rope_theta": DEFAULT_THETA,
                        **(nested.get(kind) or {"rope_type": "default"}),
                    },
                }
            )
            for kind in LAYER_TYPES
        }
    full = {**config, "rope_theta": config.get("rope_theta", DEFAULT_THETA)}
    return {
        "full_attention": rope_parameters(full),
        "sliding_attention": rope_parameters({"rope_theta": DEFAULT_THETA}),
    }


class Attention(olmo2.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.layer_type = args.layer_types[layer]
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        return super().forward(x, frames[self.layer_type], cache)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        # attend_scaled: the sliding layers' cache may keep only their window (frame.plan).
        return attend_scaled(q, k, v, self.layer, frame, cache, self.scale)


class Model(LayerTypes, olmo2.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention)
        self.model.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, args.max_position_embeddings
        )
