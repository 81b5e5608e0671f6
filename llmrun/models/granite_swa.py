"""IBM Granite 4.x with sliding-window attention (GraniteSWAForCausalLM, dense;
llama.cpp's "granite_swa" GGUFs): Granite 3 (granite.py: the embedding, residual,
attention and logit multipliers) whose layers are either sliding-window or full
attention (`layer_types`; by default every fourth from the first is full), each with a
learned attention sink per head (a logit in every softmax's denominator, as gpt-oss's),
and a RoPE base per layer (`layer_rope_theta`; 0: that layer has no positional
encoding, NoPE). The MoE variant (granitemoe_swa.py) shares these pieces.

Reference: transformers/models/granite_swa/modeling_granite_swa.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import granite
from llmrun.models.base import (
    Frame,
    RotaryEmbedding,
    args_from_config,
    layer_frames,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache
from llmrun.models.gpt_oss import attend_with_sinks

FULL_EVERY = 4  # transformers' default layer_types: layers 0, 4, 8, ... full


@dataclass
class ModelArgs(granite.ModelArgs):
    rms_norm_eps: float = 1e-5  # GraniteSWAConfig's defaults
    tie_word_embeddings: bool = True
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    layer_rope_theta: list[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if i % FULL_EVERY == 0 else "sliding_attention"
                for i in range(layers)
            ]
        self.layer_types = windowed_layer_types(self.layer_types, layers, self.sliding_window)
        if self.layer_rope_theta is None:
            self.layer_rope_theta = [self.rope_parameters["rope_theta"]] * layers
        if len(self.layer_rope_theta) != layers or any(t < 0 for t in self.layer_rope_theta):
            raise ModelFormatError(
                f"layer_rope_theta {self.layer_rope_theta} is not one RoPE base (0: none) "
                f"for each of the {layers} layers"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full layers."""
        return sliding_windows(self.layer_types, self.sliding_window)

    def frame_theta(self, layer: int) -> float:
        """The RoPE base whose frames `layer` takes: its own, or (NoPE) the model's."""
        return self.layer_rope_theta[layer] or self.rope_parameters["rope_theta"]


class Attention(granite.Attention):
    """Granite's attention with a sink per head, over its layer type's keys (a window
    or all), rotated by its own RoPE base or not at all."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.layer_type = args.layer_types[layer]
        self.rotary = bool(args.layer_rope_theta[layer])
        self.theta = args.frame_theta(layer)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads))

    def forward(
        self, x: torch.Tensor, frames: dict[float, dict[str, Frame]], cache: KVCache | None
    ) -> torch.Tensor:
        return super().forward(x, frames[self.theta][self.layer_type], cache)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return frame.rotate(x) if self.rotary else x

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        # The queries carry attention_multiplier / head_dim^-0.5 (granite.Attention).
        scale = self.head_dim**-0.5
        return attend_with_sinks(q, k, v, self.layer, frame, cache, scale, self.sinks)


class Model(granite.Model):
    """Granite with a Frame per layer type and RoPE base (frames[theta][layer_type])."""

    def __init__(self, args: ModelArgs, mlp: type = granite.MLP) -> None:
        super().__init__(args, mlp, Attention)
        base = args.rope_parameters["rope_theta"]
        thetas = sorted({t for t in args.layer_rope_theta if t and t != base})
        self.thetas = [base, *thetas]
        # Non-persistent buffers: none of them is in a checkpoint.
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(
                {**args.rope_parameters, "rope_theta": theta},
                args.head_dim,
                args.max_position_embeddings,
            )
            for theta in thetas
        )

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[float, dict[str, Frame]]:
        """layer_frames' Frame per layer type (full layers see every earlier position,
        sliding ones the last sliding_window), once for each RoPE base of the model."""
        frames = layer_frames(
            positions, cache, dtype, self.args.sliding_window, self.model.rotary_emb, last=last
        )
        out = {self.thetas[0]: frames}
        capacity = cache.max_seq_len if cache is not None else None
        for theta, rotary in zip(self.thetas[1:], self.rotaries, strict=True):
            cos, sin = rotary(positions, capacity)
            # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
            cos, sin = cos[:, None].to(dtype), sin[:, None].to(dtype)
            out[theta] = {
                kind: dataclasses.replace(frame, cos=cos, sin=sin) for kind, frame in frames.items()
            }
        return out
