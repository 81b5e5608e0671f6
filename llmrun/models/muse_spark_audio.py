"""Muse Spark's audio encoder: a causal convolutional pyramid over the raw 24 kHz waveform
(no spectrogram). Each stage folds `patch_size` steps into one (a linear layer over them,
then an RMSNorm) and runs its blocks: x + mlp(norm(depthwise causal conv(x))). An RMSNorm,
a projection to the text's width and another RMSNorm follow; the text model's weightless
embedding norm then puts each token's features where a token embedding would be.

Reference: transformers/models/muse_spark/modeling_muse_spark.py (MuseSparkAudioModel,
MuseSparkModel.get_audio_features).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import RMSNorm, activation
from llmrun.models.muse_glimmer import unit_rms


@dataclass
class EncoderArgs:
    # MuseSparkAudioConfig's defaults; text_eps is the text model's rms_norm_eps.
    patch_sizes: list[int]
    hidden_sizes: list[int]
    depths: list[int]
    mlp_ratio: float = 4.0
    conv_kernel_size: int = 7
    hidden_act: str = "gelu"
    rms_norm_eps: float = 1e-6
    out_hidden_size: int = 8192
    text_eps: float = 1e-5

    def __post_init__(self) -> None:
        lists = (self.patch_sizes, self.hidden_sizes, self.depths)
        if (
            not all(isinstance(v, (list, tuple)) for v in lists)
            or len({len(v) for v in lists}) != 1
            or not self.patch_sizes
        ):
            raise ModelFormatError(
                "Muse Spark's audio_config gives patch_sizes, hidden_sizes and depths of "
                f"other lengths ({self.patch_sizes}, {self.hidden_sizes}, {self.depths})"
            )
        sizes = [*self.patch_sizes, *self.hidden_sizes, self.conv_kernel_size]
        depths_ok = all(isinstance(n, int) and n >= 0 for n in self.depths)
        if not (depths_ok and all(isinstance(n, int) and n > 0 for n in sizes)):
            raise ModelFormatError(
                f"Muse Spark's audio_config: patch_sizes {self.patch_sizes}, hidden_sizes "
                f"{self.hidden_sizes}, conv_kernel_size {self.conv_kernel_size} and depths "
                f"{self.depths} must be whole numbers (depths may be 0, the others not)"
            )

    @property
    def samples_per_token(self) -> int:
        return math.prod(self.patch_sizes)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a MuseSparkConfig dict (its audio_config and text_config)."""
        audio, text = config["audio_config"], config.get("text_config") or {}
        defaults = {"patch_sizes": [16, 6, 5, 4], "hidden_sizes": [256, 512, 1024, 2048]}
        values = {**defaults, "depths": [2, 2, 2, 2]}
        names = cls.__dataclass_fields__
        values.update({k: v for k, v in audio.items() if k in names and v is not None})
        values["text_eps"] = text.get("rms_norm_eps", 1e-5)
        return cls(**values)


class PatchEmbedding(nn.Module):
    def __init__(self, args: EncoderArgs, stage: int) -> None:
        super().__init__()
        width = 1 if stage == 0 else args.hidden_sizes[stage - 1]
        self.patch = args.patch_sizes[stage]
        self.proj = nn.Linear(width * self.patch, args.hidden_sizes[stage])
        self.norm = RMSNorm(args.hidden_sizes[stage], args.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, width = x.shape
        # [B, S, C] -> [B, S / P, P * C]: P consecutive steps side by side
        return self.norm(self.proj(x.reshape(batch, steps // self.patch, self.patch * width)))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs, stage: int) -> None:
        super().__init__()
        width = args.hidden_sizes[stage]
        self.fc1 = nn.Linear(width, int(width * args.mlp_ratio))
        self.fc2 = nn.Linear(int(width * args.mlp_ratio), width)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ConvBlock(nn.Module):
    def __init__(self, args: EncoderArgs, stage: int) -> None:
        super().__init__()
        width, kernel = args.hidden_sizes[stage], args.conv_kernel_size
        self.conv = nn.Conv1d(width, width, kernel, groups=width)
        self.norm = RMSNorm(width, args.rms_norm_eps)
        self.mlp = MLP(args, stage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, S, C] -> [B, C, S], padded on the left alone: each step sees itself and before
        steps = F.pad(x.transpose(1, 2), (self.conv.kernel_size[0] - 1, 0))
        return x + self.mlp(self.norm(self.conv(steps).transpose(1, 2)))


class Stage(nn.Module):
    def __init__(self, args: EncoderArgs, stage: int) -> None:
        super().__init__()
        self.patch_embedder = PatchEmbedding(args, stage)
        self.conv_blocks = nn.ModuleList(ConvBlock(args, stage) for _ in range(args.depths[stage]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedder(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


class AudioEncoder(nn.Module):
    """Waveforms [B, S] (S a multiple of samples_per_token) -> token features
    [B, S / samples_per_token, out_hidden_size], as the text model takes them."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(Stage(args, i) for i in range(len(args.hidden_sizes)))
        self.norm = RMSNorm(args.hidden_sizes[-1], args.rms_norm_eps)
        self.proj = nn.Linear(args.hidden_sizes[-1], args.out_hidden_size)
        self.post_proj_norm = RMSNorm(args.out_hidden_size, args.rms_norm_eps)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        x = samples[..., None]  # [B, S] -> [B, S, 1]
        for stage in self.layers:
            x = stage(x)
        x = self.post_proj_norm(self.proj(self.norm(x)))
        return unit_rms(x, self.args.text_eps)
