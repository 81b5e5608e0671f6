"""MiniCPM-V 4.6's (and 4.7's) image encoder: a tile (the whole image resized, or one slice
of it) -> soft tokens in the language model's width, one per 4x4 patches (16x, the
default) or per 2x2 (4x).

SigLIP's patch embedding and encoder layers (llmrun.models.siglip), each patch given the
learned position nearest its fraction of the way along either axis of a
side x side table (NaViT-style: tiles of any shape). In 16x mode, after layer
insert_layer_id a window merger folds each 2x2 window of patches into one: attention
within the window (on the layer-normed states, with a residual), then LayerNorm, an MLP
of the four states side by side (GELU, tanh) plus their mean; the remaining layers run
on the halved grid. After the final LayerNorm the merger folds 2x2 squares again:
LayerNorm, Linear, GELU (erf), Linear into the text width.

Reference: transformers/models/minicpmv4_6/modeling_minicpmv4_6.py (MiniCPMV4_6VisionModel,
MiniCPMV4_6ViTWindowAttentionMerger, MiniCPMV4_6Merger; vision_utils'
get_vision_nearest_position_ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip

# MiniCPMV4_6VisionConfig's defaults, for the fields a config.json leaves out.
VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
}
MERGER_EPS = 1e-6  # MiniCPMV4_6DownsampleMLP's pre_norm, whatever the config says


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    insert_layer_id: int = 6
    # 16x: the window merger after insert_layer_id, then the merger; 4x: the merger alone.
    window_merge: bool = True

    def __post_init__(self) -> None:
        layers = self.vision.num_hidden_layers
        if self.window_merge and not 0 <= self.insert_layer_id < layers:
            raise ModelFormatError(
                f"insert_layer_id {self.insert_layer_id} is not one of the vision tower's "
                f"{layers} layers"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a MiniCPMV4_6ForConditionalGeneration (or 4.7's) config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            kind = config.get("model_type")
            raise ModelFormatError(f"a {kind} config without vision_config or text_config")
        if "hidden_size" not in text:
            raise ModelFormatError("a text_config without hidden_size")
        for name, default in (("window_kernel_size", [2, 2]), ("merge_kernel_size", [2, 2])):
            source = vision if name == "window_kernel_size" else config
            if list(source.get(name) or default) != [2, 2]:
                raise ModelFormatError(f"{name} {source[name]!r}: MiniCPM-V 4.6 merges 2x2")
        if (config.get("merger_times") or 1) != 1:
            raise ModelFormatError(
                f"merger_times {config['merger_times']!r}: llmrun runs one merge round"
            )
        mode = config.get("downsample_mode") or "16x"
        if mode not in ("16x", "4x"):
            raise ModelFormatError(f"downsample_mode {mode!r}: not 16x or 4x")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        return cls(
            siglip.VisionArgs.from_config(vision),
            text["hidden_size"],
            config.get("insert_layer_id", 6),
            mode == "16x",
        )

    @property
    def merge(self) -> int:
        """The side of the square of patches one soft token takes (4, or 2 in 4x mode)."""
        return 4 if self.window_merge else 2


def position_ids(rows: int, columns: int, side: int) -> torch.Tensor:
    """The learned position [rows * columns] of each patch of a rows x columns grid on a
    side x side table: each axis's fraction i / count bucketed in float32 as
    get_vision_nearest_position_ids does it (rounding decides a boundary's bucket)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    along = [
        torch.bucketize(torch.arange(count) / count, boundaries, right=True)
        for count in (rows, columns)
    ]
    return (along[0][:, None] * side + along[1][None, :]).flatten()


def squares(x: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """[N, rows * columns, dim] states of a grid (row by row) -> [N, squares, 4, dim]:
    each 2x2 square's four (top left, top right, bottom left, bottom right), the squares
    row by row."""
    batch, _, dim = x.shape
    # [N, rows/2, 2, columns/2, 2, dim] -> [N, rows/2, columns/2, 2, 2, dim]
    x = x.view(batch, rows // 2, 2, columns // 2, 2, dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, -1, 4, dim)


class Embeddings(nn.Module):
    def __init__(self, args: siglip.VisionArgs) -> None:
        super().__init__()
        size = args.patch_size
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, size, stride=size)
        self.position_embedding = nn.Embedding(args.patches_per_side**2, args.hidden_size)


class WindowMerger(nn.Module):
    """MiniCPMV4_6ViTWindowAttentionMerger: [N, rows * columns, dim] -> [N, rows/2 *
    columns/2, dim]."""

    def __init__(self, args: siglip.VisionArgs) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.layer_norm_eps
        self.self_attn = siglip.Attention(args)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.pre_norm = nn.LayerNorm(4 * dim, eps=eps)
        self.linear_1 = nn.Linear(4 * dim, 4 * args.intermediate_size)
        self.linear_2 = nn.Linear(4 * args.intermediate_size, dim)

    def forward(self, x: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        batch, _, dim = x.shape
        windows = squares(x, rows, columns)  # [N, W, 4, dim]
        normed = squares(self.layer_norm1(x), rows, columns)
        # Each window's four states attend to each other only.
        attended = self.self_attn(normed.reshape(-1, 4, dim)).view(windows.shape)
        windows = windows + attended
        flat = self.pre_norm(windows.flatten(2))  # [N, W, 4 * dim]
        out = self.linear_2(F.gelu(self.linear_1(flat), approximate="tanh"))
        return out + windows.mean(dim=2)


class VisionTower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args.vision)
        self.encoder = siglip.Encoder(args.vision)
        self.post_layernorm = nn.LayerNorm(args.vision.hidden_size, eps=args.vision.layer_norm_eps)
        if args.window_merge:
            self.vit_merger = WindowMerger(args.vision)


class DownsampleMLP(nn.Module):
    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(4 * hidden, eps=MERGER_EPS)
        self.linear_1 = nn.Linear(4 * hidden, 4 * hidden)
        self.linear_2 = nn.Linear(4 * hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.pre_norm(x))))


class Merger(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.mlp = nn.ModuleList([DownsampleMLP(args.vision.hidden_size, args.text_hidden_size)])


class ImageEncoder(nn.Module):
    """Tiles of one size [N, 3, H, W] (sides multiples of patch_size * merge) -> soft
    tokens [N, H * W / (patch_size * merge)², text hidden], row by row, with HF's module
    names (vision_tower, merger)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args)
        self.merger = Merger(args)

    def tower_states(self, pixels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """The vision tower's final states [N, tokens, hidden] of tiles [N, 3, H, W] (the
        window merger's halved grid in 16x mode) and that grid's rows and columns."""
        tower, patch = self.vision_tower, self.args.vision.patch_size
        rows, columns = pixels.shape[2] // patch, pixels.shape[3] // patch
        # [N, hidden, rows, columns] -> [N, patches, hidden], patches row by row
        x = tower.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        positions = position_ids(rows, columns, self.args.vision.patches_per_side)
        x = x + tower.embeddings.position_embedding(positions.to(x.device))
        for index, layer in enumerate(tower.encoder.layers):
            x = layer(x)
            if self.args.window_merge and index == self.args.insert_layer_id:
                x = tower.vit_merger(x, rows, columns)
                rows, columns = rows // 2, columns // 2
        return tower.post_layernorm(x), rows, columns

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x, rows, columns = self.tower_states(pixels)
        return self.merger.mlp[0](squares(x, rows, columns).flatten(2))
