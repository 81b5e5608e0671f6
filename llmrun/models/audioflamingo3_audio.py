"""Audio Flamingo 3's and Music Flamingo's audio encoders: one 30-second window of log-mel
features -> tokens in the language model's width.

Whisper's tower with Qwen2-Audio's average pool (llmrun.models.whisper_encoder: the frames
the window's audio reaches attend only to each other, pairs averaged before the final
LayerNorm, one token per 40 ms), then a projector of two linear layers with biases and an
activation between them.

Music Flamingo turns the tower's output before the projector by rotary time embeddings:
the first `rotary_dim` features in adjacent pairs, half of them by the window's index in
its clip and half by the frame's index in its window, each angle then scaled by the
frame's time in seconds (window * 30 + frame * 0.04, as -2 pi t). Computed in float32 as
transformers computes them (the angles reach thousands of radians), applied in float64.

References: transformers/models/audioflamingo3/modeling_audioflamingo3.py
(AudioFlamingo3Encoder, AudioFlamingo3MultiModalProjector,
AudioFlamingo3Model.get_audio_features); transformers/models/musicflamingo/
modeling_musicflamingo.py (MusicFlamingoRotaryEmbedding, apply_rotary_time_emb,
MusicFlamingoModel._build_audio_timestamps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models.base import activation
from llmrun.models.whisper_encoder import EncoderArgs, WhisperEncoder


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.linear_1 = nn.Linear(args.hidden_size, args.text_hidden_size)
        self.linear_2 = nn.Linear(args.text_hidden_size, args.text_hidden_size)
        self.act = activation(args.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class AudioFlamingo3Encoder(nn.Module):
    """The Whisper tower with its pool and the projector, HF's names."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.audio_tower = WhisperEncoder(args, pool=True)
        self.multi_modal_projector = Projector(args)

    def forward(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        """One window's log-mel features [1, mel bins, chunk_frames] of which its audio
        reaches the first `frames` -> its tokens [positions // 2, text hidden], where
        positions = (frames - 1) // 2 + 1 are the frames the convolutions leave of them."""
        return self.multi_modal_projector(self.tower(features, frames))

    def tower(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        """The tower's output [positions // 2, hidden] for forward's window."""
        if tuple(features.shape[1:]) != (self.args.num_mel_bins, self.args.chunk_frames):
            raise ValueError(f"audio features of shape {list(features.shape)}")
        positions = (frames - 1) // 2 + 1
        # The convolutions reach one mel frame each way: 2 * positions + 1 frames make them.
        return self.audio_tower(features[:, :, : 2 * positions + 1], positions)[0]


@dataclass(frozen=True)
class TimeRope:
    """MusicFlamingoConfig's rotary time settings."""

    theta: float  # rope_parameters' rope_theta; also the positions its angles divide
    dim: int  # the features each axis turns: int(audio hidden * partial_rotary_factor)
    frame_step: float  # seconds of one mel frame (audio_frame_step); a token is 4 of them


class MusicFlamingoEncoder(AudioFlamingo3Encoder):
    """Audio Flamingo 3's encoder with rotary time embeddings before the projector."""

    def __init__(self, args: EncoderArgs, rope: TimeRope):
        super().__init__(args)
        self.rope = rope

    def forward(self, features: torch.Tensor, frames: int, window: int = 0) -> torch.Tensor:
        """One window (the `window`-th of its clip) -> its tokens, as Audio Flamingo 3's."""
        return self.multi_modal_projector(self._turned(self.tower(features, frames), window))

    def _turned(self, x: torch.Tensor, window: int) -> torch.Tensor:
        """x [tokens, hidden], a window's first tokens, turned by their times."""
        rope, tokens = self.rope, len(x)
        per_window = self.args.max_source_positions // 2  # a window's tokens
        step = rope.frame_step * 4
        # float32 throughout, in transformers' order of operations.
        inv_freq = 1.0 / (
            rope.theta ** (torch.arange(0, rope.dim, 2, dtype=torch.float) / rope.dim)
        )
        positions = torch.arange(tokens, dtype=torch.float32) / rope.theta * (2 * math.pi)
        time_freqs = torch.repeat_interleave(positions[:, None] * inv_freq, 2, dim=-1)
        window_position = torch.tensor(float(window)) / rope.theta
        window_freqs = torch.repeat_interleave(window_position * inv_freq, 2, dim=-1)
        freqs = torch.cat((window_freqs.expand(tokens, -1), time_freqs), dim=-1)
        starts = torch.tensor(window * per_window) * step
        timestamps = starts + torch.arange(tokens, dtype=torch.float32) * step
        freqs = freqs * (-timestamps * 2 * math.pi)[:, None]
        cos, sin = freqs.cos().double(), freqs.sin().double()
        turned = x.double()
        rotated, passthrough = turned[:, : freqs.shape[-1]], turned[:, freqs.shape[-1] :]
        # Adjacent pairs (a, b) -> (-b, a).
        pairs = rotated.reshape(tokens, -1, 2)
        swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return torch.cat((rotated * cos + swapped * sin, passthrough), dim=-1).to(x.dtype)
