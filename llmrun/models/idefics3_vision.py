"""Idefics3's and SmolVLM's image encoder: an image tile -> tile_tokens soft tokens in the
language model's width. SigLIP's patch states (llmrun.models.siglip's layers), each patch
given the learned position of where it lies in its tile (Idefics3VisionEmbeddings: a
tile of other than image_size pixels maps its patches onto the position grid by
fractions), then the connector: a pixel shuffle that folds each scale_factor x
scale_factor square of patches into one token of scale_factor² times the width, and a
linear projection (no bias).

Reference: transformers/models/smolvlm/modeling_smolvlm.py (SmolVLMVisionEmbeddings,
SmolVLMConnector, SmolVLMModel.get_image_features), identical to idefics3's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip

# SmolVLMVisionConfig's defaults, for the fields SmolVLM2's config.json files leave out.
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 32,
}


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    scale_factor: int = 2

    def __post_init__(self) -> None:
        if self.scale_factor < 1 or self.vision.patches_per_side % self.scale_factor:
            raise ModelFormatError(
                f"scale_factor {self.scale_factor} does not divide the "
                f"{self.vision.patches_per_side} patches of a tile's side"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an Idefics3ForConditionalGeneration or SmolVLMForConditionalGeneration
        config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError(f"a {config.get('model_type')} config without vision_config")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        if "hidden_size" not in text:
            raise ModelFormatError("a text_config without hidden_size")
        return cls(
            siglip.VisionArgs.from_config(vision),
            text["hidden_size"],
            config.get("scale_factor") or 2,
        )

    @property
    def tile_tokens(self) -> int:
        """The soft tokens of an image_size tile."""
        return (self.vision.patches_per_side // self.scale_factor) ** 2


def position_ids(rows: int, columns: int, side: int) -> torch.Tensor:
    """The learned position [rows * columns] of each patch of a grid of rows x columns
    patches, on a position grid of side x side: each patch's fraction of the way along
    either axis, bucketed as Idefics3VisionEmbeddings does it (in float32: rounding
    decides the bucket of a patch that lands on a boundary)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    coords = []
    for count in (rows, columns):
        step = 1.0 / torch.tensor([count])
        fractions = torch.arange(count, dtype=torch.float32)[None, :] * step[:, None]
        fractions = torch.clamp(fractions, max=1.0 - 1e-6)
        coords.append(torch.bucketize(fractions, boundaries, right=True)[0])
    return (coords[0][:, None] * side + coords[1][None, :]).flatten()


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, side², dim] patch states of square tiles -> [N, (side / scale)², dim * scale²],
    each token the states of a scale x scale square of patches, in SmolVLMConnector's
    order."""
    batch, seq, dim = x.shape
    side = int(seq**0.5)
    # [N, side, side / s, dim * s]: s neighbours along a row side by side
    x = x.view(batch, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    # [N, side / s, side / s, dim * s²]: then s neighbouring rows
    x = x.reshape(batch, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(batch, seq // scale**2, dim * scale * scale)


class ModalityProjection(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.vision.hidden_size * args.scale_factor**2
        self.proj = nn.Linear(width, args.text_hidden_size, bias=False)


class Connector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.scale_factor = args.scale_factor
        self.modality_projection = ModalityProjection(args)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(states, self.scale_factor))


class ImageEncoder(nn.Module):
    """Tiles [N, 3, H, W] -> soft tokens [N, tokens, text hidden], with HF's module names
    (vision_model, connector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = siglip.VisionTransformer(args.vision)
        self.connector = Connector(args)

    def patch_states(self, pixels: torch.Tensor) -> torch.Tensor:
        """The SigLIP tower's hidden states [N, patches, hidden] of tiles [N, 3, H, W]
        (sides multiples of patch_size)."""
        body, patch = self.vision_model, self.args.vision.patch_size
        rows, columns = pixels.shape[2] // patch, pixels.shape[3] // patch
        # [N, hidden, rows, columns] -> [N, patches, hidden], patches row by row
        x = body.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        positions = position_ids(rows, columns, self.args.vision.patches_per_side)
        x = x + body.embeddings.position_embedding(positions.to(x.device))
        for layer in body.encoder.layers:
            x = layer(x)
        return body.post_layernorm(x)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.connector(self.patch_states(pixels))
