"""SmolLM3 (HuggingFaceTB/SmolLM3-3B): Llama whose NoPE layers apply no RoPE to their
queries and keys, every fourth layer by default (`no_rope_layers`, 1 where a layer
rotates, or `no_rope_layer_interval`).

Reference: transformers/models/smollm3/modeling_smollm3.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config


@dataclass
class ModelArgs(llama.ModelArgs):
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_sliding_window:
            raise UnsupportedError("SmolLM3 with use_sliding_window=true is not supported")
        # transformers reads sliding_window only with use_sliding_window.
        self.sliding_window = None
        if self.no_rope_layers is None:
            interval = self.no_rope_layer_interval
            if not isinstance(interval, int) or interval <= 0:
                raise ModelFormatError(
                    f"no_rope_layer_interval is {interval!r}, not a positive whole number"
                )
            self.no_rope_layers = [
                int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)
            ]
        if len(self.no_rope_layers) != self.num_hidden_layers:
            raise ModelFormatError(
                f"no_rope_layers lists {len(self.no_rope_layers)} layers, but "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.use_rope = bool(args.no_rope_layers[layer])

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return frame.rotate(x) if self.use_rope else x


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
