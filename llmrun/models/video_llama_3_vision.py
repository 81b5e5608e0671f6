"""VideoLLaMA3's image encoder: an image's patches (row by row) -> soft tokens in the
language model's width, one per patch (images are not merged: the processor's merge_size
1). A NaViT-style SigLIP without a position table: each patch through a Conv2d, blocks of
attention over the whole image with a 2D RoPE and a MLP (PaddleOCR-VL's:
llmrun.models.paddleocr_vl_vision), a final LayerNorm; the projector (readout) is
Linear-GELU-Linear.

Reference: transformers/models/video_llama_3/modular_video_llama_3.py
(VideoLlama3VisionModel, VideoLlama3VisionEmbeddings, VideoLlama3Projector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.paddleocr_vl_vision import EncoderLayer, rotary_angles


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    out_hidden_size: int  # the language model's width
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    spatial_merge_size: int = 1  # an image's: each patch a token

    def __post_init__(self) -> None:
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise UnsupportedError(f"vision activation {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads "
                "of a multiple of 4 features (the 2D RoPE turns a quarter by rows, a quarter "
                "by columns)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def temporal_patch_size(self) -> int:
        """A patch's frames: one (VideoLlama3ImageProcessor's temporal_patch_size)."""
        return 1

    @property
    def patch_features(self) -> int:
        """The values of one flattened patch: channels x patch_size²."""
        return self.num_channels * self.patch_size**2


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        p = args.patch_size
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, p, p)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        a = self.args
        # [N, C*P*P] -> [N, C, P, P] -> [N, hidden]
        pixels = patches.view(-1, a.num_channels, a.patch_size, a.patch_size)
        return self.patch_embedding(pixels).view(-1, a.hidden_size)


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))


class Tower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        out = args.out_hidden_size
        self.readout = nn.Sequential(
            nn.Linear(args.hidden_size, out), nn.GELU(), nn.Linear(out, out)
        )


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, C * P * P] (row by row) -> tokens [grid_h * grid_w,
    out_hidden_size], with HF's module names (vision_model.*, projector.readout.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = Tower(args)
        self.projector = Projector(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        if patches.shape != (grid_h * grid_w, self.args.patch_features):
            raise ValueError(
                f"patches {tuple(patches.shape)} are not a {grid_h}x{grid_w} grid of "
                f"{self.args.patch_features} values"
            )
        tower = self.vision_model
        x = tower.embeddings(patches)
        cos, sin = rotary_angles(self.args, grid_h, grid_w)
        for layer in tower.encoder.layers:
            x = layer(x, cos, sin)
        return self.projector.readout(tower.post_layernorm(x))
