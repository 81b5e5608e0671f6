"""HyperCLOVA X SEED (naver-hyperclovax/HyperCLOVAX-SEED-Think-14B, HyperCLOVAXForCausalLM):
Granite's muP scalars (granite.py) with two differences: an RMSNorm after each sublayer's
output as well as before its input ("Peri-LN", `use_post_norm`), the residual multiplier
applied after that norm; and the logits multiplied by logits_scaling where Granite divides.
attention_multiplier defaults to head_dim^-0.5 (Llama's scores), not Granite's 1.

Reference: transformers/models/hyperclovax/modular_hyperclovax.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from llmrun.models import base, granite, llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, RMSNorm, args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(granite.ModelArgs):
    max_position_embeddings: int = 2048
    attention_multiplier: float | None = None
    use_post_norm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_multiplier is None:
            self.attention_multiplier = self.head_dim**-0.5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(llama.Attention):
    """Llama's attention with scores q.k * attention_multiplier."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        # attend() scales the scores by head_dim^-0.5; queries scaled by this make the
        # product attention_multiplier.
        self.query_scale = args.attention_multiplier * args.head_dim**0.5

    def scale_queries(self, q: torch.Tensor, frame: Frame) -> torch.Tensor:
        return q * self.query_scale


class DecoderLayer(base.DecoderLayer):
    """x + post_norm1(attn(norm(x))) * m, then x + post_norm2(mlp(norm(x))) * m, with m
    the residual multiplier (no post norms where use_post_norm is false)."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        if args.use_post_norm:
            self.post_norm1 = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.post_norm2 = RMSNorm(args.hidden_size, args.rms_norm_eps)
        else:
            self.post_norm1, self.post_norm2 = nn.Identity(), nn.Identity()
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        attended = self.post_norm1(self.self_attn(self.input_layernorm(x), frame, cache))
        x = x + attended * self.residual_multiplier
        fed = self.post_norm2(self.mlp(self.post_attention_layernorm(x)))
        return x + fed * self.residual_multiplier


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, DecoderLayer)

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
        """CausalLM.forward's logits times logits_scaling. `images` (HyperCLOVA X SEED
        Vision's) are scaled by embedding_multiplier as text's embeddings are: transformers
        scales the embeddings after it places them."""
        if images is not None and self.args.embedding_multiplier != 1.0:
            images = replace(images, embeds=images.embeds * self.args.embedding_multiplier)
        logits = super().forward(input_ids, positions, cache, last_only, last, static, images)
        return logits * self.args.logits_scaling
