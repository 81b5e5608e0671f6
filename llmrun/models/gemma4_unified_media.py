"""Gemma 4 Unified's image and audio embedders: no encoder. An image's patches (each
patch_size * pooling_kernel_size pixels square, its rows, columns and channels flat) go
through LayerNorm -> Linear -> LayerNorm, plus a learned embedding of their column and
one of their row, -> LayerNorm; a clip's raw waveform frames (audio_embed_dim samples
each) go in as they are. Both then meet the language model through an RMSNorm without
scale and a Linear (Gemma4UnifiedMultimodalEmbedder).

Reference: transformers/models/gemma4_unified/modeling_gemma4_unified.py
(Gemma4UnifiedVisionEmbedder, Gemma4UnifiedMultimodalEmbedder) and
configuration_gemma4_unified.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.models.gemma3n import RMSNorm


@dataclass
class VisionArgs:
    patch_size: int = 16
    pooling_kernel_size: int = 3
    mm_embed_dim: int = 3840
    mm_posemb_size: int = 1120
    rms_norm_eps: float = 1e-6
    text_hidden_size: int = 3840

    @classmethod
    def from_config(cls, vision: dict[str, Any], text_hidden: int) -> VisionArgs:
        names = ("patch_size", "pooling_kernel_size", "mm_embed_dim", "mm_posemb_size",
                 "rms_norm_eps")  # fmt: skip
        return cls(**{k: vision[k] for k in names if vision.get(k) is not None},
                   text_hidden_size=text_hidden)  # fmt: skip

    @property
    def model_patch_size(self) -> int:
        """The side of a patch the embedder takes, in pixels."""
        return self.patch_size * self.pooling_kernel_size


@dataclass
class AudioArgs:
    audio_embed_dim: int = 640  # samples a frame (40 ms at 16 kHz), one token each
    rms_norm_eps: float = 1e-6
    text_hidden_size: int = 3840


class Projection(nn.Module):
    """x [N, width] -> Linear(x / rms(x)) [N, text hidden] (Gemma4UnifiedMultimodalEmbedder)."""

    def __init__(self, width: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(width, eps, with_scale=False)
        self.embedding_projection = nn.Linear(width, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class ImageEmbedder(nn.Module):
    """An image's patches [N, model_patch^2 * 3] at (column, row) positions [N, 2] ->
    soft tokens [N, text hidden], with HF's module names (embed_vision's)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        width, dim = args.model_patch_size**2 * 3, args.mm_embed_dim
        self.patch_ln1 = nn.LayerNorm(width)  # torch's default eps, as transformers'
        self.patch_dense = nn.Linear(width, dim)
        self.patch_ln2 = nn.LayerNorm(dim)
        self.pos_embedding = nn.Parameter(torch.zeros(args.mm_posemb_size, 2, dim))
        self.pos_norm = nn.LayerNorm(dim)
        self.multimodal_embedder = Projection(dim, args.text_hidden_size, args.rms_norm_eps)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.patch_ln2(self.patch_dense(self.patch_ln1(patches)))
        # [N, 2] -> the column's embedding (axis 0) plus the row's (axis 1)
        x = x + self.pos_embedding[positions[:, 0], 0] + self.pos_embedding[positions[:, 1], 1]
        return self.multimodal_embedder(self.pos_norm(x))


class AudioEmbedder(nn.Module):
    """A clip's frames [N, audio_embed_dim] -> soft tokens [N, text hidden], with HF's
    module names (embed_audio's)."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_audio = Projection(args.audio_embed_dim, args.text_hidden_size,
                                      args.rms_norm_eps)  # fmt: skip

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.embed_audio(frames)
