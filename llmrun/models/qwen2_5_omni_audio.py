"""Qwen2.5-Omni's audio encoder: one clip's log-mel features [mel bins, frames] -> its
tokens [tokens, text hidden].

Whisper's layers (llmrun.models.whisper_encoder.EncoderLayer) over windows: the frames are
cut into chunks of 2 * n_window (2 seconds), each chunk run through the two convolutions
on its own (its edges see zeros, not its neighbours), given the sinusoidal positions from
0, and attending only to itself; then every pair of frames averaged (one token per 40 ms),
a LayerNorm (ln_post) and a linear projection to the language model's width (proj).

Reference: transformers/models/qwen2_5_omni/modeling_qwen2_5_omni.py
(Qwen2_5OmniAudioEncoder, chunk_and_pad_features, get_pool_indices, SinusoidsPositionEmbedding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation
from llmrun.models.whisper_encoder import EncoderArgs as WhisperArgs
from llmrun.models.whisper_encoder import EncoderLayer


@dataclass
class EncoderArgs(WhisperArgs):
    """Qwen2_5OmniAudioEncoderConfig's fields (text_hidden_size is its output_dim)."""

    n_window: int = 100  # half a chunk's mel frames

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            not isinstance(self.n_window, int)
            or isinstance(self.n_window, bool)
            or self.n_window < 1
        ):
            raise ModelFormatError(f"audio n_window is {self.n_window!r}, not a positive number")


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """SinusoidsPositionEmbedding's table [length, channels]: sines, then cosines."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioTower(nn.Module):
    """Qwen2_5OmniAudioEncoder under its HF names (audio_tower.*)."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        width = args.hidden_size
        self.args = args
        self.conv1 = nn.Conv1d(args.num_mel_bins, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.ln_post = nn.LayerNorm(width, eps=args.layer_norm_eps)
        self.proj = nn.Linear(width, args.text_hidden_size)
        self.act = activation(args.activation_function)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[mel bins, frames] (the frames the clip's audio reaches) -> [tokens, text hidden],
        tokens = ((frames - 1) // 2 + 1) // 2."""
        chunks = []
        for chunk in features.split(2 * self.args.n_window, dim=1):
            x = self.act(self.conv1(chunk[None]))
            x = self.act(self.conv2(x)).transpose(1, 2)  # [1, positions, width]
            x = x + sinusoids(x.shape[1], x.shape[2]).to(x.dtype)
            for layer in self.layers:
                x = layer(x)
            chunks.append(x[0])
        x = torch.cat(chunks)
        # Pairs of frames averaged; an odd last frame is dropped (get_pool_indices).
        pairs = x.shape[0] // 2
        x = x[: 2 * pairs].view(pairs, 2, -1).mean(dim=1)
        return self.proj(self.ln_post(x))


class Qwen25OmniAudioEncoder(nn.Module):
    """The thinker's audio tower, as its checkpoint names it (audio_tower.*)."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.audio_tower = AudioTower(args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.audio_tower(features)
