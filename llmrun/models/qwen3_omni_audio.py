"""Qwen3-Omni's audio encoder: one clip's log-mel features [mel bins, frames] -> its tokens
[tokens, text hidden].

The frames are cut into chunks of 2 * n_window (1 second), the last zero-padded to the
longest chunk's length; each chunk goes through three 3x3 Conv2d of stride 2 over (mel
bins, frames) with GELU, its channels and mel rows flattened into one vector per frame
left (one per 80 ms begun of a chunk: 13 a second), a linear layer without bias
(conv_out) and the sinusoidal positions from 0. The tokens of the chunks' real frames are
then concatenated and go through pre-LayerNorm layers (attention with biases on q, k, v
and out) that attend within windows of n_window_infer frames' tokens (8 chunks on the
Hub), then ln_post, proj1, GELU, proj2.

Reference: transformers/models/qwen3_omni_moe/modeling_qwen3_omni_moe.py
(Qwen3OmniMoeAudioEncoder, chunk_and_pad_features, get_valid_indices,
get_audio_cu_seqlens, _get_feat_extract_output_lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation
from llmrun.models.qwen2_5_omni_audio import sinusoids


@dataclass
class EncoderArgs:
    """Qwen3OmniMoeAudioEncoderConfig's fields (text_hidden_size is its output_dim)."""

    hidden_size: int  # d_model
    intermediate_size: int  # encoder_ffn_dim
    num_hidden_layers: int
    num_attention_heads: int
    text_hidden_size: int
    num_mel_bins: int = 128
    downsample_hidden_size: int = 480
    n_window: int = 50  # half a chunk's mel frames
    n_window_infer: int = 800  # the mel frames of an attention window
    activation_function: str = "gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "text_hidden_size",
            "num_mel_bins",
            "downsample_hidden_size",
            "n_window",
            "n_window_infer",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"audio {name} is {value!r}, not a positive number")
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"audio d_model {self.hidden_size} is not {self.num_attention_heads} heads"
            )
        if self.n_window_infer < 2 * self.n_window:
            raise ModelFormatError(
                f"audio n_window_infer {self.n_window_infer} is less than a chunk's "
                f"{2 * self.n_window} frames"
            )

    @property
    def conv_width(self) -> int:
        """conv_out's input: the channels times the mel rows left after three halvings."""
        rows = self.num_mel_bins
        for _ in range(3):
            rows = (rows + 1) // 2
        return self.downsample_hidden_size * rows


def chunk_tokens(frames: int) -> int:
    """The tokens a chunk of `frames` mel frames makes: three halvings, each rounding up."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1  # 0 stays 0
    return frames


def clip_tokens(args: EncoderArgs, frames: int) -> int:
    """The tokens a clip of `frames` mel frames makes (_get_feat_extract_output_lengths)."""
    chunk = 2 * args.n_window
    return (frames // chunk) * chunk_tokens(chunk) + chunk_tokens(frames % chunk)


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        width = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        n, width = x.shape
        # [N, width] -> [heads, N, head_dim]
        q, k, v = (
            proj(x).view(n, self.heads, -1).transpose(0, 1)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = [
            F.scaled_dot_product_attention(a[None], b[None], c[None])[0]
            for a, b, c in zip(*(t.split(windows, 1) for t in (q, k, v)), strict=True)
        ]
        return self.out_proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, width))


class EncoderLayer(nn.Module):
    """x + attn(ln(x)) within each window, then x + fc2(act(fc1(ln(x))))."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.self_attn_layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioTower(nn.Module):
    """Qwen3OmniMoeAudioEncoder under its HF names (audio_tower.*)."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        channels = args.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, channels, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        self.conv_out = nn.Linear(args.conv_width, args.hidden_size, bias=False)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.ln_post = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.proj1 = nn.Linear(args.hidden_size, args.hidden_size)
        self.act = activation(args.activation_function)
        self.proj2 = nn.Linear(args.hidden_size, args.text_hidden_size)

    def forward(self, features: torch.Tensor, whole_chunks: bool = False) -> torch.Tensor:
        """[mel bins, frames] -> [clip_tokens(frames), text hidden]; `whole_chunks`: the
        last chunk zero-padded to a whole one whatever the clip's length, as Qwen3-ASR's
        feature extractor pads it (Qwen3-Omni pads it to the longest chunk's)."""
        args = self.args
        chunks = list(features.split(2 * args.n_window, dim=1))
        longest = 2 * args.n_window if whole_chunks else chunks[0].shape[1]
        # [chunks, 1, mel bins, longest]: the last chunk zero-padded, as pad_sequence does
        x = torch.stack([F.pad(c, (0, longest - c.shape[1])) for c in chunks])[:, None]
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
        b, c, f, t = x.shape
        # [chunks, channels, mel rows, t] -> [chunks, t, channels * mel rows]
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        x = x + sinusoids(t, args.hidden_size).to(x.dtype)
        x = torch.cat([row[: chunk_tokens(c.shape[1])] for row, c in zip(x, chunks, strict=True)])
        # Attention windows: n_window_infer's worth of the longest chunk's tokens.
        window = chunk_tokens(longest) * (args.n_window_infer // (2 * args.n_window))
        windows = [window] * (len(x) // window) + ([len(x) % window] if len(x) % window else [])
        for layer in self.layers:
            x = layer(x, windows)
        return self.proj2(self.act(self.proj1(self.ln_post(x))))


class Qwen3OmniAudioEncoder(nn.Module):
    """The thinker's audio tower, as its checkpoint names it (audio_tower.*)."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.audio_tower = AudioTower(args)

    def forward(self, features: torch.Tensor, whole_chunks: bool = False) -> torch.Tensor:
        return self.audio_tower(features, whole_chunks)
