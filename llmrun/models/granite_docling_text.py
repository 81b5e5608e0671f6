"""Granite Docling's language model: IBM Granite (llmrun.models.granite) whose image
tokens carry DeepStack features. An image token's embedding is 1 + K vectors side by side
(llmrun.models.granite_docling_vision): the first takes the <image> token's place and is
scaled by embedding_multiplier as text embeddings are (transformers scales after placing
them), vector k + 1 is added to the token's hidden state after decoder layer k.

Reference: transformers/models/granite_docling/modular_granite_docling.py
(GraniteDoclingTextModel.forward, GraniteDoclingModel.forward).
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
    image_token_id: int = 100337  # GraniteDoclingConfig's default
    deepstack_layers: int = 3  # the vision config's deepstack_visual_indexes, counted

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


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
        rows at <image> tokens are the features side by side; the other rows of a span,
        the markers between tiles, take their own embeddings) enter as described above."""
        if images is None:
            return super().forward(input_ids, positions, cache, last_only, last, static)
        x = self.embed(input_ids)
        hidden, count = x.shape[-1], self.args.deepstack_layers
        if images.embeds.shape[-1] != hidden * (1 + count):
            raise ModelFormatError(
                f"image features of width {images.embeds.shape[-1]} for {count} DeepStack "
                f"layers of width {hidden}"
            )
        rows = images.groups >= 0
        # [span tokens, 1 + K, hidden] -> those at <image> tokens
        features = images.embeds.to(x.dtype).view(-1, 1 + count, hidden)
        soft = rows & (input_ids[0] == self.args.image_token_id)
        features = features[soft[rows]]
        x[0, soft] = features[:, 0] * self.args.embedding_multiplier
        frame = self.frame(positions, cache, x.dtype, last)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, frame, cache)
            if i < count:
                x[0, soft] += features[:, i + 1]
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float() / self.args.logits_scaling
