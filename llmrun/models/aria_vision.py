"""Aria's image encoder: one crop (an image resized into a square of max_image_size pixels,
its real part only) -> a fixed number of soft tokens in the language model's width.
Idefics3's SigLIP tower (each patch given the learned position of where it lies in the
crop's real part: llmrun.models.idefics3_vision.position_ids), its hidden states after
`feature_layer` layers (no final norm), then the projector: learned queries, as many as
the square's patch count maps to, attend to the patches (each side LayerNorm-ed and
projected, then torch's MultiheadAttention, then a Linear), a LayerNorm and a GELU MLP to
the text's width, no residual anywhere.

The padding the processor puts below and right of the image is masked out of the tower's
attention and the projector's (a patch with any real pixel counts as real): running the
tower on the real patches alone gives the same states, which is what this does.

Reference: transformers/models/aria/modeling_aria.py (AriaProjector, AriaCrossAttention,
AriaModel.get_image_features), transformers/models/idefics3/modeling_idefics3.py
(Idefics3VisionEmbeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.base import activation
from llmrun.models.idefics3_vision import VISION_DEFAULTS, position_ids

# AriaConfig's projector_patch_to_query_dict: patches of a 490- or 980-pixel square (14-pixel
# patches) -> queries.
PATCH_TO_QUERY = {1225: 128, 4900: 256}


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    feature_layer: int  # hidden states after this many tower layers
    patch_to_query: dict[int, int]

    def __post_init__(self) -> None:
        layers = self.vision.num_hidden_layers
        if not 0 <= self.feature_layer <= layers:
            raise ModelFormatError(
                f"vision_feature_layer {self.feature_layer} is not a hidden state 0..{layers}"
            )
        ok = self.patch_to_query and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0
            for pair in self.patch_to_query.items()
            for v in pair
        )
        if not ok:
            raise ModelFormatError(
                f"projector_patch_to_query_dict {self.patch_to_query!r} is not patch counts "
                "to query counts"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an AriaForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("an aria config without vision_config or text_config")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        args = siglip.VisionArgs.from_config(vision)
        layer = config.get("vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ModelFormatError(f"vision_feature_layer is {layer!r}; llmrun takes one layer")
        mapping = config.get("projector_patch_to_query_dict") or PATCH_TO_QUERY
        try:
            mapping = {int(k): v for k, v in mapping.items()}
        except (AttributeError, TypeError, ValueError):
            raise ModelFormatError(f"projector_patch_to_query_dict is {mapping!r}") from None
        return cls(
            args,
            text.get("hidden_size", 4096),  # AriaTextConfig's default
            layer if layer >= 0 else args.num_hidden_layers + 1 + layer,
            mapping,
        )

    @property
    def max_queries(self) -> int:
        return max(self.patch_to_query.values())


class CrossAttention(nn.Module):
    """The queries over the patches: LayerNorm-ed and projected each, torch's
    MultiheadAttention (its own projections), a Linear."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim, heads = args.vision.hidden_size, args.vision.num_attention_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.multihead_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.linear = nn.Linear(dim, dim)
        self.layer_norm = nn.LayerNorm(dim)
        self.layer_norm_kv = nn.LayerNorm(dim)

    def forward(self, patches: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        query = self.q_proj(self.layer_norm(queries))
        patches = self.layer_norm_kv(patches)
        out, _ = self.multihead_attn(
            query, self.k_proj(patches), self.v_proj(patches), need_weights=False
        )
        return self.linear(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.linear_in = nn.Linear(dim, width, bias=False)
        self.linear_out = nn.Linear(width, width, bias=False)
        self.act = activation("gelu_pytorch_tanh")  # transformers' gelu_new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(self.act(self.linear_in(x)))


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim = args.vision.hidden_size
        self.query = nn.Parameter(torch.zeros(args.max_queries, dim))
        self.cross_attn = CrossAttention(args)
        self.layer_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, args.text_hidden_size)

    def forward(self, patches: torch.Tensor, queries: int) -> torch.Tensor:
        query = self.query[:queries].expand(len(patches), queries, -1)
        return self.feed_forward(self.layer_norm(self.cross_attn(patches, query)))


class ImageEncoder(nn.Module):
    """A crop's real patches [N, 3, rows * patch, columns * patch] of a `square`-pixel
    square -> soft tokens [N, queries, text hidden], with HF's module names (vision_tower,
    multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = siglip.VisionTransformer(args.vision)
        self.multi_modal_projector = Projector(args)

    def queries(self, square: int) -> int:
        """The soft tokens of a crop of a `square`-pixel square."""
        patches = (square // self.args.vision.patch_size) ** 2
        if patches not in self.args.patch_to_query:
            raise ModelFormatError(
                f"crops of {square} pixels make {patches} patches, which "
                f"projector_patch_to_query_dict {self.args.patch_to_query} does not map"
            )
        return self.args.patch_to_query[patches]

    def patch_states(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's hidden states [N, patches, hidden] after feature_layer layers."""
        body, patch = self.vision_tower, self.args.vision.patch_size
        rows, columns = pixels.shape[2] // patch, pixels.shape[3] // patch
        # [N, hidden, rows, columns] -> [N, patches, hidden], patches row by row
        x = body.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        positions = position_ids(rows, columns, self.args.vision.patches_per_side)
        x = x + body.embeddings.position_embedding(positions.to(x.device))
        for layer in body.encoder.layers[: self.args.feature_layer]:
            x = layer(x)
        return x

    def forward(self, pixels: torch.Tensor, square: int) -> torch.Tensor:
        return self.multi_modal_projector(self.patch_states(pixels), self.queries(square))
