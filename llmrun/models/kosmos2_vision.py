"""Kosmos-2's image encoder: an image [N, 3, S, S] -> its latent_query_num tokens [N,
queries, text hidden].

CLIP's whole vision transformer with its post_layernorm over every token
(llmrun.models.git_vision.ClipTower), each token L2-normalized; then the image-to-text
projection: the tokens through a Linear to the text's width, and the learned latent
queries attending (one attention of the text's heads, biased q, k, v, out projections, no
mask) to those tokens and to the queries themselves.

Reference: transformers/models/kosmos2/modeling_kosmos2.py (Kosmos2Model.get_image_features,
Kosmos2ImageToTextProjection, KosmosTextAttention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models.git_vision import ClipTower
from llmrun.models.llava_vision import VisionArgs


@dataclass
class EncoderArgs:
    vision: VisionArgs
    text_hidden_size: int
    text_heads: int  # the projection's attention heads: the text config's
    queries: int  # latent_query_num


class VisionModel(nn.Module):
    """Kosmos2VisionModel's module names (model.*)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.model = ClipTower(args)


class CrossAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        batch, dim = queries.shape[0], queries.shape[-1]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, T, H*D] -> [N, H, T, D]
            return t.view(batch, t.shape[1], self.heads, -1).transpose(1, 2)

        q = heads(self.q_proj(queries))
        k, v = heads(self.k_proj(keys)), heads(self.v_proj(keys))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, -1, dim))


class Projection(nn.Module):
    """Kosmos2ImageToTextProjection: dense, latent_query, x_attn."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.text_hidden_size
        self.dense = nn.Linear(args.vision.hidden_size, width)
        self.latent_query = nn.Parameter(torch.zeros(args.queries, width))
        self.x_attn = CrossAttention(width, args.text_heads)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.dense(features)
        queries = self.latent_query.expand(len(x), -1, -1)
        return self.x_attn(queries, torch.cat([x, queries], dim=1))


class ImageEncoder(nn.Module):
    """Kosmos2Model's image modules under their names (vision_model,
    image_to_text_projection)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = VisionModel(args.vision)
        self.image_to_text_projection = Projection(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        states = F.normalize(self.vision_model.model(pixels), dim=-1)
        return self.image_to_text_projection(states)
