"""Janus-Pro's image encoder (its understanding half): an image [N, 3, S, S] -> soft tokens
[N, patches, text hidden].

A SigLIP vision transformer (llmrun.models.siglip: learned absolute positions, pre-norm
layers, a final LayerNorm; Janus names its attention's output projection
projection_layer, renamed to out_proj where it loads), every patch's hidden state through
the aligner: Linear, then (activation, Linear) depth - 1 times, to the language model's
width. The image-generation half (VQ model, generation embeddings, aligner and head) is
not here: llmrun only reads images.

Reference: transformers/models/janus/modeling_janus.py (JanusVisionModel,
JanusVisionAlignerMLP, JanusModel.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import siglip
from llmrun.models.base import activation


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    projection_dim: int  # the aligner's width: the language model's hidden size
    depth: int = 2  # the aligner's Linear layers
    hidden_act: str = "gelu"  # the aligner's, JanusVisionConfig's hidden_act as the tower's

    def __post_init__(self) -> None:
        for name in ("projection_dim", "depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"Janus vision {name} is {value!r}")
        activation(self.hidden_act)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a JanusConfig dict's vision_config (JanusVisionConfig's defaults)."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError("a Janus config without a vision_config")
        if vision.get("use_qk_norm"):
            raise UnsupportedError("a Janus vision tower with q/k norms (use_qk_norm)")
        if vision.get("attention_bias", True) is not True:
            raise UnsupportedError("a Janus vision tower without attention biases")
        hidden = vision.get("hidden_size", 1024)
        ratio = vision.get("mlp_ratio", 4.0)
        if not isinstance(hidden, int) or not isinstance(ratio, int | float) or ratio <= 0:
            raise ModelFormatError(f"Janus vision hidden_size {hidden!r}, mlp_ratio {ratio!r}")
        act = vision.get("hidden_act", "gelu")
        tower = siglip.VisionArgs(
            hidden_size=hidden,
            intermediate_size=int(hidden * ratio),
            num_hidden_layers=vision.get("num_hidden_layers", 24),
            num_attention_heads=vision.get("num_attention_heads", 16),
            image_size=vision.get("image_size", 384),
            patch_size=vision.get("patch_size", 16),
            num_channels=vision.get("num_channels", 3),
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            hidden_act=act,
        )
        return cls(tower, vision.get("projection_dim", 2048), vision.get("depth", 2), act)

    @property
    def tokens_per_image(self) -> int:
        return self.vision.patches_per_side**2


class Aligner(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.projection_dim
        self.fc1 = nn.Linear(args.vision.hidden_size, width)
        self.hidden_layers = nn.ModuleList(nn.Linear(width, width) for _ in range(args.depth - 1))
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        for layer in self.hidden_layers:
            x = layer(self.act(x))
        return x


class ImageEncoder(nn.Module):
    """Pixels [N, C, S, S] -> soft tokens [N, (S / patch)², projection_dim], with HF's
    module names after model. (vision_model.embeddings, ..., aligner.fc1)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = siglip.VisionTransformer(args.vision)
        self.aligner = Aligner(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        tower = self.vision_model
        x = tower.embeddings(pixels)
        for layer in tower.encoder.layers:
            x = layer(x)
        return self.aligner(tower.post_layernorm(x))
