"""IBM Granite 3.x dense models (GraniteForCausalLM; llama.cpp's "granite" GGUFs): Llama
with four scalars from muP training: the embeddings times embedding_multiplier, each
sublayer's output times residual_multiplier before it joins the residual stream, the
attention scores scaled by attention_multiplier (instead of head_dim^-0.5) and the
logits divided by logits_scaling.

Reference: transformers/models/granite/modeling_granite.py. Parameter names are Hugging
Face checkpoint keys. The MoE variants (granitemoe.py) share these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(llama.Attention):
    """Llama's attention with scores q.k * attention_multiplier, its output scaled by
    residual_multiplier."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        # attend() scales the scores by head_dim^-0.5 (so do the paged and native kernels);
        # queries scaled by this make the product attention_multiplier.
        self.query_scale = args.attention_multiplier * args.head_dim**0.5
        self.residual_multiplier = args.residual_multiplier

    def scale_queries(self, q: torch.Tensor, frame: Frame) -> torch.Tensor:
        return q * self.query_scale

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        return super().forward(x, frame, cache) * self.residual_multiplier


class MLP(GatedMLP):
    """Llama's feed-forward, its output scaled by residual_multiplier."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class Model(CausalLM):
    def __init__(self, args: ModelArgs, mlp: type = MLP, attention: type = Attention) -> None:
        super().__init__(args, attention, mlp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.args.embedding_multiplier

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
        """CausalLM.forward's logits divided by logits_scaling. `images` (Granite Speech's
        audio tokens) are scaled by embedding_multiplier as text's embeddings are:
        transformers scales the embeddings after it places them."""
        if images is not None and self.args.embedding_multiplier != 1.0:
            images = replace(images, embeds=images.embeds * self.args.embedding_multiplier)
        logits = super().forward(input_ids, positions, cache, last_only, last, static, images)
        return logits / self.args.logits_scaling
