"""GIT's image encoder: an image [N, 3, S, S] -> its tokens [N, (S / patch)² + 1, text
hidden], every token's, the class token first.

CLIP's whole vision transformer (llmrun.models.llava_vision's embeddings and layers, then
its post_layernorm over every token, not the pooled class token alone), then the visual
projection: a Linear to the text's width and a LayerNorm (of the vision config's epsilon).

Reference: transformers/models/git/modeling_git.py (GitVisionTransformer, GitProjection,
GitModel.forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models.llava_vision import Embeddings, Encoder, VisionArgs


@dataclass
class EncoderArgs:
    vision: VisionArgs
    text_hidden_size: int


class ClipTower(nn.Module):
    """CLIPVisionTransformer: embeddings, pre_layrnorm, the layers, post_layernorm over
    every token."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        eps = args.layer_norm_eps
        self.embeddings = Embeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=eps)
        self.encoder = Encoder(args, args.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class VisionModel(nn.Module):
    """GitVisionModel's module names (vision_model.*)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.vision_model = ClipTower(args)


class Projection(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.text_hidden_size
        self.visual_projection = nn.Sequential(
            nn.Linear(args.vision.hidden_size, width),
            nn.LayerNorm(width, eps=args.vision.layer_norm_eps),
        )


class ImageEncoder(nn.Module):
    """GitModel's image modules under their names, git. dropped (image_encoder,
    visual_projection)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.image_encoder = VisionModel(args.vision)
        self.visual_projection = Projection(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        states = self.image_encoder.vision_model(pixels)
        return self.visual_projection.visual_projection(states)
