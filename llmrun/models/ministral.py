"""Ministral (Ministral-8B-Instruct-2410, MinistralForCausalLM): Mistral whose layers each
attend either to every earlier position or to the last sliding_window of them, as
`layer_types` says (every layer sliding where it lists none and a window is set, every
layer full where no window is).

Reference: transformers/models/ministral/modeling_ministral.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.models import llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    LayerTypes,
    args_from_config,
    attend_scaled,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        self.layer_types = windowed_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full-attention layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(llama.Attention):
    """Llama's attention over its layer type's frame."""

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


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
