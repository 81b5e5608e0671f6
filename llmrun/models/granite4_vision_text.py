"""Granite 4 Vision's language model: IBM Granite (llmrun.models.granite) whose decoder
layers take an image in. An image token's embedding is K streams side by side
(llmrun.models.granite4_vision), stream k for decoder layer image_layers[k]: the token
enters as zeros (not scaled by embedding_multiplier) and each stream is added to it just
before its layer.

Reference: transformers/models/granite4_vision/modeling_granite4_vision.py
(Granite4VisionTextModel.forward, Granite4VisionModel.forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import ModelFormatError
from llmrun.models import granite
from llmrun.models.base import args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(granite.ModelArgs):
    # The decoder layers the image streams go to, in stream order (ascending).
    image_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        args = args_from_config(cls, config)
        args.image_layers = tuple(args.image_layers)
        layers = list(args.image_layers)
        if layers != sorted(set(layers)) or any(
            not isinstance(i, int) or not 0 <= i < args.num_hidden_layers for i in layers
        ):
            raise ModelFormatError(
                f"image layers {layers} are not distinct decoder layers of the "
                f"{args.num_hidden_layers} in ascending order"
            )
        return args


class Model(granite.Model):
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """Granite's logits; `images` (one row, llmrun.models.gemma3.ImageTokens whose
        embeddings are the streams side by side) enter their layers."""
        if images is None:
            return super().forward(input_ids, positions, cache, last_only, last, static)
        rows = images.groups >= 0
        x = self.embed(input_ids.masked_fill(rows, 0))
        hidden = x.shape[-1]
        layers = self.args.image_layers
        if images.embeds.shape[-1] != hidden * len(layers):
            raise ModelFormatError(
                f"image features of width {images.embeds.shape[-1]} for {len(layers)} image "
                f"layers of width {hidden}"
            )
        streams = images.embeds.to(x.dtype).view(-1, len(layers), hidden)
        x[0, rows] = 0
        frame = self.frame(positions, cache, x.dtype, last)
        for i, layer in enumerate(self.model.layers):
            if i in layers:
                x[0, rows] += streams[:, layers.index(i)]
            x = layer(x, frame, cache)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float() / self.args.logits_scaling
