"""Phi-4-multimodal's image encoder: an image's crops (a global view and the crops of its HD
canvas, each crop_size pixels square) -> its soft tokens in the language model's width.

SigLIP's layers (llmrun.models.siglip) up to feature_layer, over each crop's patches; a
crop's padded patches (right and bottom of the canvas) get position 0, and the rest take
the learned positions of their fraction of the valid region (as Idefics3's, whose
bucketing it shares), and only valid patches are attended to. Each crop's patch states
are averaged over 2x2 squares (after a reflection pad where a side is odd). The HD crops'
states are laid out as the canvas, cut to its valid part, each row ended by a learned
separator (sub_img_feature_extensor); then a learned token (global_img_feature_extensor)
and the global view's rows, each ended by the separator too. A GELU MLP projects them.

Reference: transformers/models/phi4_multimodal/modeling_phi4_multimodal.py
(Phi4MultimodalVisionEmbeddings, Phi4MultimodalImageEmbedding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.idefics3_vision import position_ids

# Phi4MultimodalVisionConfig's defaults (Phi-4-multimodal-instruct's).
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "image_size": 448,
    "patch_size": 14,
    "crop_size": 448,
    "feature_layer": -2,
    "image_token_id": 200010,
}


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    crop_size: int = 448
    feature_layer: int = -2

    def __post_init__(self) -> None:
        if self.crop_size != self.vision.image_size:
            raise ModelFormatError(
                f"vision crop_size {self.crop_size} is not its image_size {self.vision.image_size}"
            )
        if not 0 < self.layers <= self.vision.num_hidden_layers:
            raise ModelFormatError(
                f"vision feature_layer {self.feature_layer} is not one of its "
                f"{self.vision.num_hidden_layers} layers"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Phi4MultimodalConfig dict (config.json)."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError("a phi4_multimodal config without vision_config")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        return cls(
            siglip.VisionArgs.from_config(vision),
            config.get("hidden_size") or 3072,
            vision["crop_size"],
            vision["feature_layer"],
        )

    @property
    def layers(self) -> int:
        """The tower's layers that run: hidden_states[feature_layer] is the output of
        this many (index 0 is the embeddings')."""
        count = self.vision.num_hidden_layers
        return self.feature_layer if self.feature_layer >= 0 else count + 1 + self.feature_layer

    @property
    def side(self) -> int:
        """A crop's soft tokens along a side: its patches' after the 2x2 average."""
        return (self.vision.patches_per_side + 1) // 2


class VisionTower(nn.Module):
    """SigLIP's embeddings and layers with HF's names (img_processor.*); its post-norm and
    pooling head are never run, so not loaded."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.embeddings = siglip.Embeddings(args.vision)
        self.encoder = siglip.Encoder(
            siglip.VisionArgs(**{**args.vision.__dict__, "num_hidden_layers": args.layers})
        )


def _attend(attn: siglip.Attention, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """SigLIP's attention where every patch sees only the valid patches ([N, T] bools)."""
    batch, tokens, dim = x.shape
    # [N, T, dim] -> [N, heads, T, head_dim]
    q, k, v = (
        proj(x).view(batch, tokens, attn.heads, -1).transpose(1, 2)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    return attn.out_proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class ImageEncoder(nn.Module):
    """An image's crops [1 + rows * columns, 3, crop, crop] and their patch masks -> soft
    tokens [tokens, text hidden], with HF's module names (model.embed_tokens_extend.
    image_embed.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        width = args.vision.hidden_size
        self.img_processor = VisionTower(args)
        self.img_projection_up = nn.Linear(width, args.text_hidden_size)
        self.img_projection_down = nn.Linear(args.text_hidden_size, args.text_hidden_size)
        self.global_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, width))
        self.sub_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, 1, width))

    def crop_states(self, crops: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Each crop's patch states [N, side², hidden] after the 2x2 average; `masks`
        [N, patches, patches] marks its valid patches (a top-left rectangle)."""
        tower, side = self.img_processor, self.args.vision.patches_per_side
        valid = masks.bool()
        # [N, hidden, side, side] -> [N, side², hidden], patches row by row
        x = tower.embeddings.patch_embedding(crops).flatten(2).transpose(1, 2)
        positions = torch.zeros(valid.shape, dtype=torch.long)
        for i, crop in enumerate(valid):
            rows, columns = int(crop[:, 0].sum()), int(crop[0, :].sum())
            grid = position_ids(rows, columns, side).view(rows, columns)
            positions[i, :rows, :columns] = grid
        x = x + tower.embeddings.position_embedding(positions.flatten(1).to(x.device))
        keys = valid.flatten(1).to(x.device)
        for layer in tower.encoder.layers:
            x = x + _attend(layer.self_attn, layer.layer_norm1(x), keys)
            x = x + layer.mlp(layer.layer_norm2(x))
        # [N, side², hidden] -> [N, hidden, side, side] -> 2x2 means -> [N, side'², hidden]
        x = x.view(x.shape[0], side, side, -1).permute(0, 3, 1, 2)
        if side % 2:
            x = F.pad(x, (0, 1, 0, 1), mode="reflect")
        x = F.avg_pool2d(x, 2)
        return x.permute(0, 2, 3, 1).flatten(1, 2)

    def forward(
        self, crops: torch.Tensor, masks: torch.Tensor, rows: int, columns: int
    ) -> torch.Tensor:
        """The soft tokens of one image: crops[0] its global view, then its canvas's
        rows x columns crops row by row, `masks` their valid patches."""
        states = self.crop_states(crops, masks)
        side, width = self.args.side, states.shape[-1]
        separator = self.sub_img_feature_extensor[0]  # [1, 1, hidden]
        whole = states[0].view(side, side, width)
        whole = torch.cat([whole, separator.expand(side, 1, width)], dim=1).flatten(0, 1)
        # [rows * columns, side², hidden] -> the canvas [rows * side, columns * side, hidden]
        canvas = states[1 : 1 + rows * columns].view(rows, columns, side, side, width)
        canvas = canvas.transpose(1, 2).reshape(rows * side, columns * side, width)
        kept = masks[1 : 1 + rows * columns, ::2, ::2].reshape(rows, columns, side, side)
        kept = kept.transpose(1, 2).reshape(rows * side, columns * side)
        height, breadth = int(kept[:, 0].sum()), int(kept[0, :].sum())
        canvas = canvas[:height, :breadth]
        canvas = torch.cat([canvas, separator.expand(height, 1, width)], dim=1).flatten(0, 1)
        tokens = torch.cat([canvas, self.global_img_feature_extensor[0], whole])
        return self.img_projection_down(F.gelu(self.img_projection_up(tokens)))
