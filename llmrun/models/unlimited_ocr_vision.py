"""Unlimited-OCR's image encoder: a view [N, 3, S, S] (the padded whole image, or one crop)
-> its grid's tokens [N, S / 64, S / 64, text hidden].

DeepSeek-OCR's: SAM's ViT-B with its neck and two stride-2 convolutions (DeepSeek-OCR 2's,
llmrun.models.deepseek_ocr2_vision.Sam), whose feature map is CLIP-L's patch embeddings: a
class token in front, the learned positions (resized bicubically, antialiased, where the
grid differs from the table's), a LayerNorm, pre-norm layers (attention, quick-GELU MLP).
Each grid cell's CLIP output (the class token dropped) and its SAM feature, concatenated,
are projected linearly to the text width. llmrun.unlimited_ocr_images lays the grids out
with the learned image_newline after each row and view_seperator after the whole image.

Reference: transformers/models/unlimited_ocr/modeling_unlimited_ocr.py
(UnlimitedOcrVisionModel, UnlimitedOcrVisionEmbeddings, UnlimitedOcrModel.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models.deepseek_ocr2_vision import Sam, SamArgs
from llmrun.models.llava_vision import Layer, VisionArgs


@dataclass
class EncoderArgs:
    sam: SamArgs
    clip: VisionArgs
    text_hidden_size: int


class ClipEmbeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(args.hidden_size))
        self.position_embedding = nn.Embedding(args.patches_per_side**2 + 1, args.hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """SAM's features [N, C, h, w] -> [N, 1 + h * w, C], positions added."""
        batch, dim, height, width = features.shape
        patches = features.flatten(2).mT
        table = self.position_embedding.weight
        side = round((table.shape[0] - 1) ** 0.5)
        if (height, width) != (side, side):
            grid = table[1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
            grid = F.interpolate(
                grid, size=(height, width), mode="bicubic", antialias=True, align_corners=False
            )
            table = torch.cat([table[:1], grid.permute(0, 2, 3, 1).reshape(-1, dim)])
        classes = self.class_embedding.expand(batch, 1, -1)
        return torch.cat([classes, patches], dim=1) + table


class ClipTransformer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


class Clip(nn.Module):
    """CLIP-L over SAM's features (DeepSeek's names: model.vision_model.*)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.embeddings = ClipEmbeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.transformer = ClipTransformer(args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(features))
        for layer in self.transformer.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.sam.downsample_channels[-1] + args.clip.hidden_size
        self.layers = nn.Linear(width, args.text_hidden_size)


class ImageEncoder(nn.Module):
    """SAM, CLIP and the projector, with the learned row newline and view separator
    (DeepSeek's names after model.)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.sam_model = Sam(args.sam)
        self.vision_model = Clip(args.clip)
        self.projector = Projector(args)
        self.image_newline = nn.Parameter(torch.zeros(args.text_hidden_size))
        self.view_seperator = nn.Parameter(torch.zeros(args.text_hidden_size))

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        """Views of one size [N, 3, S, S] -> their grids' tokens [N, h, w, text hidden]."""
        features = self.sam_model(views)  # [N, C, h, w]
        batch, _, height, width = features.shape
        clip = self.vision_model(features)[:, 1:]
        both = torch.cat([clip, features.flatten(2).mT], dim=-1)
        return self.projector.layers(both).reshape(batch, height, width, -1)
