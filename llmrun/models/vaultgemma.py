"""VaultGemma (google/vaultgemma-1b, trained with differential privacy): Gemma 2 without
its norms after attention and after the feed-forward, x + attn(norm(x)), then
x + mlp(pre_ffw_norm(x)); the rest (embeddings scaled by sqrt(hidden), scores by
query_pre_attn_scalar^-0.5, sliding and global layers, soft-capped scores and logits)
is Gemma 2's.

Reference: transformers/models/vaultgemma/modeling_vaultgemma.py. llama.cpp has no
converter for it: HF folders only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrun.models import gemma2
from llmrun.models.base import Frame
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(gemma2.ModelArgs):
    """Gemma 2's config fields, defaults and checks (VaultGemmaConfig is Gemma2Config)."""


class DecoderLayer(gemma2.DecoderLayer):
    """Gemma 2's layer with its two post-norms taken out."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        del self.post_attention_layernorm
        del self.post_feedforward_layernorm

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frames, cache)
        return x + self.mlp(self.pre_feedforward_layernorm(x))


class Body(gemma2.Body):
    layer = DecoderLayer


class Model(gemma2.Model):
    body = Body
