"""Granite Docling's image encoder: a tile [3, S, S] -> tokens [tokens, (1 + K) * text
hidden], its image features then its K DeepStack features side by side.

Idefics3's SigLIP tower (llmrun.models.siglip; tiles are always image_size, so each patch
takes its own learned position); the connector normalizes the last hidden states
(ln_in), pixel-shuffles them as Idefics3's connector does (llmrun.models.idefics3_vision),
projects them (no bias), adds a fixed 2D sine-cosine position per token ([columns | rows],
vit_mae's halves swapped), then GELU(LayerNorm), a projection (no bias) and a LayerNorm.
Each DeepStack merger reads the raw hidden states after one tower layer
(deepstack_visual_indexes), pixel-shuffled alike: LayerNorm, Linear, GELU, Linear. The
language model (llmrun.models.granite_docling_text) adds merger k's features to the image
tokens after its decoder layer k. The fine path (use_fine_route) shuffles by half the
factor and has its own projection and mergers; the norms and the output projection are
shared.

Reference: transformers/models/granite_docling/modular_granite_docling.py
(GraniteDoclingConnector, GraniteDoclingConnectorPath, GraniteDoclingVisionModel.encode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.idefics3_vision import pixel_shuffle

# GraniteDoclingVisionConfig's defaults (Idefics3VisionConfig's where it sets none), for
# fields a config.json leaves out.
VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 512,
    "patch_size": 16,
}


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    scale_factor: int = 4
    deepstack_visual_indexes: tuple[int, ...] = (3, 7, 10)
    use_fine_route: bool = True

    def __post_init__(self) -> None:
        side = self.vision.patches_per_side
        factors = (self.scale_factor, self.scale_factor // 2) if self.use_fine_route else ()
        if self.scale_factor < 1 or any(f < 1 or side % f for f in factors or [self.scale_factor]):
            raise ModelFormatError(
                f"scale_factor {self.scale_factor} (and half of it, for the fine path) does "
                f"not divide the {side} patches of a tile's side"
            )
        layers = self.vision.num_hidden_layers
        indexes = self.deepstack_visual_indexes
        if len(set(indexes)) != len(indexes) or any(not 0 <= i < layers for i in indexes):
            raise ModelFormatError(
                f"deepstack_visual_indexes {list(indexes)} are not distinct layers of the "
                f"tower's {layers}"
            )
        if self.text_hidden_size % 4:
            raise ModelFormatError(
                f"a text hidden size of {self.text_hidden_size}: the 2D position embedding "
                "needs a multiple of 4"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a GraniteDoclingForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("a granite_docling config without vision_config or text_config")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        indexes = vision.get("deepstack_visual_indexes", [3, 7, 10])
        if not isinstance(indexes, list) or not all(isinstance(i, int) for i in indexes):
            raise ModelFormatError(f"deepstack_visual_indexes is {indexes!r}, not a list of layers")
        return cls(
            siglip.VisionArgs.from_config(vision),
            vision.get("out_hidden_size", 1024),
            vision.get("scale_factor", 4),
            tuple(indexes),
            bool(vision.get("use_fine_route", True)),
        )

    def tile_tokens(self, fine: bool) -> int:
        """The image tokens of one tile, on the fine path or the coarse one."""
        scale = self.scale_factor // 2 if fine else self.scale_factor
        return (self.vision.patches_per_side // scale) ** 2


def position_embedding(dim: int, side: int) -> torch.Tensor:
    """The fixed [side², dim] sine-cosine position of each token of a side x side grid, row
    by row: [sin, cos of the column | sin, cos of the row] (GraniteDoclingPositionEmbedding)."""
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows, columns = torch.meshgrid(
        torch.arange(side, dtype=torch.float64),
        torch.arange(side, dtype=torch.float64),
        indexing="ij",
    )
    by_column, by_row = columns.flatten().outer(omega), rows.flatten().outer(omega)
    table = [by_column.sin(), by_column.cos(), by_row.sin(), by_row.cos()]
    return torch.cat(table, dim=1).float()


class DeepStackMerger(nn.Module):
    def __init__(self, args: EncoderArgs, scale: int) -> None:
        super().__init__()
        width = args.vision.hidden_size * scale**2
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, args.text_hidden_size)
        self.linear_2 = nn.Linear(args.text_hidden_size, args.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.layer_norm(x))))


class ConnectorPath(nn.Module):
    """One pixel-shuffle factor's projection, position embedding and DeepStack mergers."""

    def __init__(self, args: EncoderArgs, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.side = args.vision.patches_per_side // scale
        width = args.vision.hidden_size * scale**2
        self.projection = nn.Linear(width, args.text_hidden_size, bias=False)
        self.deepstack_mergers = nn.ModuleList(
            DeepStackMerger(args, scale) for _ in args.deepstack_visual_indexes
        )

    def forward(
        self, states: torch.Tensor, taps: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.projection(pixel_shuffle(states, self.scale))
        x = x + position_embedding(x.shape[-1], self.side).to(x)
        stacked = [
            m(pixel_shuffle(t.contiguous(), self.scale))
            for m, t in zip(self.deepstack_mergers, taps, strict=True)
        ]
        return x, stacked


class Connector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        text = args.text_hidden_size
        self.ln_in = nn.LayerNorm(args.vision.hidden_size)
        self.coarse = ConnectorPath(args, args.scale_factor)
        self.fine = ConnectorPath(args, args.scale_factor // 2) if args.use_fine_route else None
        self.ln_mid = nn.LayerNorm(text)
        self.mlp_fc2 = nn.Linear(text, text, bias=False)
        self.ln_out = nn.LayerNorm(text)

    def forward(self, states: torch.Tensor, taps: list[torch.Tensor], fine: bool) -> torch.Tensor:
        path = self.fine if fine else self.coarse
        x, stacked = path(self.ln_in(states), taps)
        x = self.ln_out(self.mlp_fc2(F.gelu(self.ln_mid(x))))
        return torch.cat([x, *stacked], dim=-1)


class Tower(siglip.VisionTransformer):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__(args.vision)
        self.connector = Connector(args)


class ImageEncoder(nn.Module):
    """Tiles [N, 3, S, S] -> tokens [N, tokens, (1 + K) * text hidden], with HF's module
    names (vision_model, its connector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = Tower(args)

    def forward(self, pixels: torch.Tensor, fine: bool = False) -> torch.Tensor:
        body = self.vision_model
        x = body.embeddings(pixels)
        taps = []
        for i, layer in enumerate(body.encoder.layers):
            x = layer(x)
            if i in self.args.deepstack_visual_indexes:
                taps.append(x)
        return body.connector(body.post_layernorm(x), taps, fine)
