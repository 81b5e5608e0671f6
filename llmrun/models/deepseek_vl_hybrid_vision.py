"""DeepSeek-VL 7B's image encoder (deepseek_vl_hybrid): an image at two sizes -> soft tokens
[N, (S / patch)², text hidden], S and patch the low-resolution tower's.

Low resolution: a SigLIP tower (llmrun.models.siglip), its patches' final hidden states.
High resolution: SAM's ViT (llmrun.models.deepseek_ocr2_vision's blocks: windowed attention
with decomposed relative positions, global in a few layers) with its neck; the output of
the first global layer goes through a second neck of its own, and each neck's features are
resized bilinearly to 4x the low-resolution grid and narrowed by two stride-2
convolutions (one pair of convolutions for both), then summed, the second scaled by a
learned alpha. The aligner projects each side to half the text width, joins them (high
resolution first), GELU, Linear.

Reference: transformers/models/deepseek_vl_hybrid/modeling_deepseek_vl_hybrid.py
(DeepseekVLHybridModel.get_image_features, DeepseekVLSamVisionProj,
DeepseekVLHybridAligner).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.deepseek_ocr2_vision import ChannelNorm, SamArgs, SamBlock


@dataclass
class EncoderArgs:
    low: siglip.VisionArgs
    high: SamArgs  # its downsample_channels unused
    text_hidden_size: int

    def __post_init__(self) -> None:
        if self.text_hidden_size % 2:
            raise ModelFormatError(
                f"DeepSeek-VL hybrid text hidden_size {self.text_hidden_size} is odd: its "
                "aligner gives each tower half of it"
            )
        if self.high.image_size % self.high.patch_size or not self.high.global_attn_indexes:
            raise ModelFormatError(
                "DeepSeek-VL hybrid SAM tower: image_size not a multiple of patch_size, or "
                "no global_attn_indexes"
            )

    @property
    def tokens_per_image(self) -> int:
        return self.low.patches_per_side**2


class Neck(nn.Module):
    """SamVisionNeck: [N, H, W, C] -> [N, output_channels, H, W]."""

    def __init__(self, args: SamArgs) -> None:
        super().__init__()
        out = args.output_channels
        self.conv1 = nn.Conv2d(args.hidden_size, out, 1, bias=False)
        self.layer_norm1 = ChannelNorm(out, eps=1e-6)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.layer_norm2 = ChannelNorm(out, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm1(self.conv1(x.permute(0, 3, 1, 2)))
        return self.layer_norm2(self.conv2(x))


class PatchEmbed(nn.Module):
    def __init__(self, args: SamArgs) -> None:
        super().__init__()
        size = args.patch_size
        self.projection = nn.Conv2d(3, args.hidden_size, size, stride=size)


class SamEncoder(nn.Module):
    """SamVisionEncoder's ViT and neck, with HF's names (patch_embed.projection, layers.N,
    neck); the output of the first global layer too."""

    def __init__(self, args: SamArgs) -> None:
        super().__init__()
        self.args = args
        side = args.image_size // args.patch_size
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Parameter(torch.zeros(1, side, side, args.hidden_size))
        self.layers = nn.ModuleList(
            SamBlock(args, 0 if i in args.global_attn_indexes else args.window_size)
            for i in range(args.num_hidden_layers)
        )
        self.neck = Neck(args)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels [N, 3, S, S] -> the neck's features [N, C, S/p, S/p] and the first global
        layer's output [N, S/p, S/p, hidden]."""
        x = self.patch_embed.projection(pixels).permute(0, 2, 3, 1) + self.pos_embed
        first_global = self.args.global_attn_indexes[0]
        kept = x
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == first_global:
                kept = x
        return self.neck(x), kept


class SamModel(nn.Module):
    def __init__(self, args: SamArgs) -> None:
        super().__init__()
        self.vision_encoder = SamEncoder(args)


class SamProjection(nn.Module):
    """DeepseekVLSamVisionProj: features resized to 4x the low-resolution grid, then two
    stride-2 convolutions (2x, then 4x the channels)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        channels = args.high.output_channels
        self.side = 4 * args.low.patches_per_side
        self.conv1 = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False)
        self.conv2 = nn.Conv2d(2 * channels, 4 * channels, 3, stride=2, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=(self.side, self.side), mode="bilinear", align_corners=False)
        return self.conv2(self.conv1(x))


class Aligner(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        half = args.text_hidden_size // 2
        self.vision_proj = nn.Linear(args.low.hidden_size, half)
        self.high_res_vision_proj = nn.Linear(4 * args.high.output_channels, half)
        self.proj = nn.Linear(args.text_hidden_size, args.text_hidden_size)

    def forward(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([self.high_res_vision_proj(high), self.vision_proj(low)], dim=-1)
        return self.proj(F.gelu(joined))


class ImageEncoder(nn.Module):
    """(low [N, 3, s, s], high [N, 3, S, S]) -> soft tokens [N, (s / patch)², text
    hidden], with HF's module names after model. (vision_model, high_res_vision_model,
    high_res_vision_neck, high_res_vision_proj, high_res_vision_alpha, aligner)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = siglip.VisionModel(args.low)
        self.high_res_vision_model = SamModel(args.high)
        self.high_res_vision_neck = Neck(args.high)
        self.high_res_vision_proj = SamProjection(args)
        self.high_res_vision_alpha = nn.Parameter(torch.zeros(1))
        self.aligner = Aligner(args)

    def forward(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        low_tokens = self.vision_model(low)
        last, first_global = self.high_res_vision_model.vision_encoder(high)
        grid = self.high_res_vision_proj(last) + self.high_res_vision_alpha * (
            self.high_res_vision_proj(self.high_res_vision_neck(first_global))
        )
        # [N, C, h, w] -> [N, h * w, C], row after row
        high_tokens = grid.flatten(2).transpose(1, 2)
        return self.aligner(low_tokens, high_tokens)
