"""Gemma 3n's audio encoder (E2B, E4B): the USM conformer over log-mel frames. Two
stride-2 3x3 convolutions (each looking at its frame and the two after it, normalized by a
cumulative group norm over the frames so far, ReLU) cut the frames by four and a linear
takes them to the encoder's width; each conformer layer is a half-weighted feed-forward,
local self-attention (each frame attends to itself and the frames just before it, with a
learned relative-position term and soft-capped logits), a light convolution (GLU, causal
depthwise convolution, SiLU) and a second feed-forward; every fourth frame is kept, and
the embedder (RMS norm, linear, unscaled RMS norm) takes it to the language model's
width, one soft token each. The embedder also embeds its own vocabulary ("hard" tokens:
the end-of-audio marker and the padding of a clip's tokens) through a second norm.

Reference: transformers' models/gemma3n/modeling_gemma3n.py (Gemma3nAudioEncoder,
Gemma3nMultimodalEmbedder); parameter names are its checkpoint keys (audio_tower.*,
embed_audio.*). transformers computes the attention in blocks of conf_attention_chunk_size
frames over a window of context; computed whole with the same band of keys, it is the
same sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models.gemma3n import RMSNorm
from llmrun.models.gemma4_audio import local_attention, relative_timing

NORM_EPS = 1e-6  # Gemma3nRMSNorm's default, which the conformer's norms keep


@dataclass
class AudioArgs:
    """Gemma3nAudioConfig's fields (and its defaults), and the language model's width the
    embedder projects to."""

    hidden_size: int = 1536
    input_feat_size: int = 128
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    vocab_size: int = 128
    vocab_offset: int = 262272
    conf_attention_chunk_size: int = 12
    conf_attention_context_left: int = 13
    conf_attention_context_right: int = 0
    conf_attention_logit_cap: float = 50.0
    conf_num_attention_heads: int = 8
    conf_num_hidden_layers: int = 12
    conf_conv_kernel_size: int = 5
    conf_reduction_factor: int = 4
    conf_residual_weight: float = 0.5
    sscp_conv_channel_size: tuple[int, int] = (128, 32)
    sscp_conv_group_norm_eps: float = 1e-3
    sscp_conv_kernel_size: tuple[tuple[int, int], tuple[int, int]] = ((3, 3), (3, 3))
    sscp_conv_stride_size: tuple[tuple[int, int], tuple[int, int]] = ((2, 2), (2, 2))
    text_hidden_size: int = 2048

    @classmethod
    def from_config(cls, audio: dict[str, Any], text_hidden: int) -> AudioArgs:
        known = {f.name for f in fields(cls)} - {"text_hidden_size"}
        values = {k: v for k, v in audio.items() if k in known}
        for key in ("sscp_conv_kernel_size", "sscp_conv_stride_size"):
            if key in values:
                values[key] = tuple(tuple(pair) for pair in values[key])
        if "sscp_conv_channel_size" in values:
            values["sscp_conv_channel_size"] = tuple(values["sscp_conv_channel_size"])
        return cls(**values, text_hidden_size=text_hidden)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.conf_num_attention_heads

    @property
    def past_frames(self) -> int:
        """How many frames before itself a frame attends to."""
        return max(0, self.conf_attention_context_left - 1)

    @property
    def time_stride(self) -> int:
        """How many mel frames the convolutions make one frame of."""
        return math.prod(stride for stride, _ in self.sscp_conv_stride_size)

    def conv_bins(self) -> list[int]:
        """The mel bins after each convolution (padded by one on both sides)."""
        bins = [self.input_feat_size]
        for (_, kernel), (_, stride) in zip(
            self.sscp_conv_kernel_size, self.sscp_conv_stride_size, strict=True
        ):
            bins.append((bins[-1] + 2 - kernel) // stride + 1)
        return bins[1:]


class CumulativeGroupNorm(nn.Module):
    """x [T, bins, channels] normalized at each frame by the mean and variance of all
    values up to it (each frame's squared deviations taken from its own running mean),
    scaled per channel."""

    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_frame = x[0].numel()
        count = torch.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None, None] * per_frame
        mean = torch.cumsum(x.sum(dim=(1, 2), keepdim=True), dim=0) / count
        deviation = (x - mean).pow(2).sum(dim=(1, 2), keepdim=True)
        variance = torch.cumsum(deviation, dim=0) / count
        return (x - mean) * torch.rsqrt(variance + self.eps) * self.weight


class ConvBlock(nn.Module):
    """A convolution over (frames, mel bins): the bins padded by one on both sides, the
    frames by kernel - 1 after (each output sees its frame and those after it)."""

    def __init__(self, args: AudioArgs, index: int) -> None:
        super().__init__()
        fan_in = 1 if index == 0 else args.sscp_conv_channel_size[index - 1]
        fan_out = args.sscp_conv_channel_size[index]
        kernel = args.sscp_conv_kernel_size[index]
        self.pad = (1, 1, 0, kernel[0] - 1)
        self.conv = nn.Conv2d(
            fan_in, fan_out, kernel, stride=args.sscp_conv_stride_size[index], bias=False
        )
        self.norm = CumulativeGroupNorm(fan_out, args.sscp_conv_group_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(F.pad(x, self.pad))  # [1, channels, frames, bins]
        return torch.relu(self.norm(x[0].permute(1, 2, 0))).permute(2, 0, 1)[None]


class SubSampleConvProjection(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.conv_0 = ConvBlock(args, 0)
        self.conv_1 = ConvBlock(args, 1)
        width = args.sscp_conv_channel_size[-1] * args.conv_bins()[-1]
        self.input_proj_linear = nn.Linear(width, args.hidden_size, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[frames, mel bins] -> [frames / 4, hidden]."""
        x = self.conv_1(self.conv_0(features[None, None]))
        # [1, channels, frames, bins] -> [frames, bins * channels]
        x = x[0].permute(1, 2, 0)
        return self.input_proj_linear(x.reshape(x.shape[0], -1))


class FeedForward(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.clip = args.gradient_clipping
        self.scale = args.conf_residual_weight
        self.pre_layer_norm = RMSNorm(args.hidden_size, NORM_EPS)
        self.ffw_layer_1 = nn.Linear(args.hidden_size, args.hidden_size * 4, bias=False)
        self.ffw_layer_2 = nn.Linear(args.hidden_size * 4, args.hidden_size, bias=False)
        self.post_layer_norm = RMSNorm(args.hidden_size, NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre_layer_norm(torch.clamp(x, -self.clip, self.clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        h = self.post_layer_norm(torch.clamp(h, -self.clip, self.clip))
        return x + h * self.scale


class RelativePositionEmbedding(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.pos_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)


class LocalAttention(nn.Module):
    """Local attention over the frames [T, hidden]: frame i attends to frames i - past ..
    i (gemma4_audio.local_attention)."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.args = args
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.relative_position_embedding = RelativePositionEmbedding(args)
        self.per_dim_scale = nn.Parameter(torch.zeros(args.head_dim))

    def relative_keys(self, distances: int, dtype: torch.dtype) -> torch.Tensor:
        """[distances, hidden]: each distance's sinusoid, projected
        (Gemma3nAudioRelativePositionEmbedding)."""
        timing = relative_timing(distances, self.args.hidden_size, dtype)
        return self.relative_position_embedding.pos_proj(timing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = self.args
        shape = (x.shape[0], args.conf_num_attention_heads, args.head_dim)
        q_scale = args.head_dim**-0.5 / math.log(2)  # / softplus(0)
        q = self.q_proj(x).view(shape) * q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape)
        span = args.past_frames + 1  # Gemma 4's sees one frame fewer
        relative = self.relative_keys(span, x.dtype).view(span, *shape[1:])
        return local_attention(q, k, v, relative, args.conf_attention_logit_cap)


class ConformerAttention(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.clip = args.gradient_clipping
        self.pre_attn_norm = RMSNorm(args.hidden_size, NORM_EPS)
        self.attn = LocalAttention(args)
        self.post = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.post_norm = RMSNorm(args.hidden_size, NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.pre_attn_norm(torch.clamp(x, -self.clip, self.clip)))
        return x + self.post_norm(torch.clamp(self.post(h), -self.clip, self.clip))


class LightConv(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.clip = args.gradient_clipping
        hidden = args.hidden_size
        self.pre_layer_norm = RMSNorm(hidden, args.rms_norm_eps)
        self.linear_start = nn.Linear(hidden, hidden * 2, bias=False)
        self.depthwise_conv1d = nn.Conv1d(
            hidden, hidden, args.conf_conv_kernel_size, groups=hidden, bias=False
        )
        self.conv_norm = RMSNorm(hidden, args.rms_norm_eps)
        self.linear_end = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        # Causal: each frame sees the kernel's frames up to itself.
        h = F.pad(h.T[None], (self.depthwise_conv1d.kernel_size[0] - 1, 0))
        h = self.depthwise_conv1d(h)[0].T
        h = self.conv_norm(torch.clamp(h, -self.clip, self.clip))
        return x + self.linear_end(F.silu(h))


class ConformerBlock(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.clip = args.gradient_clipping
        self.ffw_layer_start = FeedForward(args)
        self.attention = ConformerAttention(args)
        self.lconv1d = LightConv(args)
        self.ffw_layer_end = FeedForward(args)
        self.norm = RMSNorm(args.hidden_size, NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lconv1d(self.attention(self.ffw_layer_start(x)))
        x = self.ffw_layer_end(x)
        return self.norm(torch.clamp(x, -self.clip, self.clip))


class AudioTower(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.subsample_conv_projection = SubSampleConvProjection(args)
        self.conformer = nn.ModuleList(
            ConformerBlock(args) for _ in range(args.conf_num_hidden_layers)
        )


class AudioEmbedder(nn.Module):
    """Soft tokens (the tower's frames) or hard ones (ids of its vocabulary) -> the
    language model's width."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.vocab_offset = args.vocab_offset
        self.embedding = nn.Embedding(args.vocab_size, hidden)
        self.hard_embedding_norm = RMSNorm(hidden, eps)
        self.soft_embedding_norm = RMSNorm(hidden, eps)
        self.embedding_projection = nn.Linear(hidden, args.text_hidden_size, bias=False)
        self.embedding_post_projection_norm = RMSNorm(args.text_hidden_size, eps, False)

    def soft(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_post_projection_norm(
            self.embedding_projection(self.soft_embedding_norm(x))
        )

    def hard(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids of the language model's vocabulary that are this
        embedder's (vocab_offset on)."""
        x = self.hard_embedding_norm(self.embedding(ids - self.vocab_offset))
        return self.embedding_post_projection_norm(self.embedding_projection(x))


class AudioEncoder(nn.Module):
    """The audio tower and its embedder, under Gemma3nModel's names."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.args = args
        self.audio_tower = AudioTower(args)
        self.embed_audio = AudioEmbedder(args)

    def forward(self, features: torch.Tensor, valid_frames: int) -> torch.Tensor:
        """The soft tokens [tokens, text hidden] of a clip's log-mel features [frames, mel
        bins] whose first `valid_frames` frames are its audio: a frame after the
        convolutions is the clip's where its first mel frame is, and every later step
        looks back only, so the rest are cut there."""
        tower = self.audio_tower
        x = tower.subsample_conv_projection(features)
        x = x[: -(-valid_frames // self.args.time_stride)]
        for block in tower.conformer:
            x = block(x)
        return self.embed_audio.soft(x[:: self.args.conf_reduction_factor])
