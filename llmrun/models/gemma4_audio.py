"""Gemma 4's audio encoder (E2B, E4B): a conformer over log-mel frames. Two stride-2 3x3
convolutions (each masked to the clip's frames, layer-normed, ReLU) cut the frames by
four and a linear takes them to the encoder's width; each conformer layer is a
half-weighted feed-forward, local self-attention (each frame attends to itself and the
frames just before it, with a learned relative-position term and soft-capped logits), a
light convolution (GLU, causal depthwise convolution, SiLU) and a second feed-forward;
an output projection and the embedder (an unscaled RMS norm, a linear) take the frames
to the language model's width, one soft token each.

Reference: transformers' models/gemma4/modeling_gemma4.py (Gemma4AudioModel,
Gemma4MultimodalEmbedder); parameter names are its checkpoint keys (audio_tower.*,
embed_audio.*). transformers computes the attention in blocks of attention_chunk_size
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

# Gemma4RMSNorm's default eps, which the feed-forward and layer norms keep.
NORM_EPS = 1e-6


@dataclass
class AudioArgs:
    """Gemma4AudioConfig's fields (and its defaults), the mel bins the features have, and
    the language model's width the embedder projects to."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    num_mel_bins: int = 128
    text_hidden_size: int = 1536

    @classmethod
    def from_config(cls, audio: dict[str, Any], text_hidden: int, mel_bins: int) -> AudioArgs:
        known = {f.name for f in fields(cls)} - {"num_mel_bins", "text_hidden_size"}
        values = {k: v for k, v in audio.items() if k in known}
        if "subsampling_conv_channels" in values:
            values["subsampling_conv_channels"] = tuple(values["subsampling_conv_channels"])
        return cls(**values, num_mel_bins=mel_bins, text_hidden_size=text_hidden)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def past_frames(self) -> int:
        """How many frames before itself a frame attends to."""
        return self.attention_context_left - 1


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Gemma4RMSNorm: no 1 + weight)."""

    def __init__(self, dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.eps) * self.weight


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class ClippableLinear(nn.Module):
    """A linear without bias whose inputs and outputs may be clamped to learned bounds."""

    def __init__(self, args: AudioArgs, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.clipped = args.use_clipped_linears
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


class SubsampleLayer(nn.Module):
    """A stride-2 3x3 convolution over (frames, mel bins), layer norm, ReLU."""

    def __init__(self, args: AudioArgs, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(fan_in, fan_out, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(fan_out, eps=args.rms_norm_eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv(x * mask[None, None, :, None])  # the clip's padding frames as zeros
        x = torch.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))
        return x, mask[::2]


class SubsampleConvProjection(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        first, second = args.subsampling_conv_channels
        self.layer0 = SubsampleLayer(args, 1, first)
        self.layer1 = SubsampleLayer(args, first, second)
        # transformers sizes it for 128 mel bins cut by four (the loader checks them).
        self.input_proj_linear = nn.Linear((first // 4) * second, args.hidden_size, bias=False)

    def forward(
        self, features: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = self.layer0(features[None, None], mask)
        x, mask = self.layer1(x, mask)
        # [1, channels, frames, bins] -> [frames, bins * channels]
        x = x[0].permute(1, 2, 0).reshape(x.shape[2], -1)
        return self.input_proj_linear(x), mask


class FeedForward(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.clip = args.gradient_clipping
        self.scale = args.residual_weight
        self.ffw_layer_1 = ClippableLinear(args, args.hidden_size, args.hidden_size * 4)
        self.ffw_layer_2 = ClippableLinear(args, args.hidden_size * 4, args.hidden_size)
        self.pre_layer_norm = RMSNorm(args.hidden_size)
        self.post_layer_norm = RMSNorm(args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre_layer_norm(torch.clamp(x, -self.clip, self.clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        h = self.post_layer_norm(torch.clamp(h, -self.clip, self.clip))
        return x + h * self.scale


class Attention(nn.Module):
    """Local attention over the frames [T, hidden]: frame i attends to frames i - past + 1
    .. i; its logits are q.k plus q against the relative keys of each distance (a
    sinusoid of the distance, projected), soft-capped."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.args = args
        hidden = args.hidden_size
        self.q_proj = ClippableLinear(args, hidden, hidden)
        self.k_proj = ClippableLinear(args, hidden, hidden)
        self.v_proj = ClippableLinear(args, hidden, hidden)
        self.post = ClippableLinear(args, hidden, hidden)
        self.relative_k_proj = nn.Linear(hidden, hidden, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(args.head_dim))

    def relative_positions(self, distances: int, dtype: torch.dtype) -> torch.Tensor:
        """[distances, hidden] (Gemma4AudioRelPositionalEncoding): relative_timing."""
        return relative_timing(distances, self.args.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = self.args
        frames, heads, head_dim = x.shape[0], args.num_attention_heads, args.head_dim
        shape = (frames, heads, head_dim)
        q_scale = head_dim**-0.5 / math.log(2)
        k_scale = math.log(1 + math.e) / math.log(2)
        q = self.q_proj(x).view(shape) * q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).view(shape) * k_scale
        v = self.v_proj(x).view(shape)
        past = args.past_frames
        relative = self.relative_k_proj(self.relative_positions(past, x.dtype))
        relative = relative.view(past, heads, head_dim)
        return self.post(local_attention(q, k, v, relative, args.attention_logit_cap))


def relative_timing(distances: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[distances, width]: [sin, cos] of each distance 0, 1, ... at timescales from 1 to
    10^4 (the USM conformer's relative positions, Gemma 3n's and Gemma 4's)."""
    half = width // 2
    step = math.log(10000.0) / max(half - 1, 1)
    inv_timescales = torch.exp(torch.arange(half) * -step)
    scaled = torch.arange(distances)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1).to(dtype)


def local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, relative: torch.Tensor, cap: float
) -> torch.Tensor:
    """The USM conformer's local attention over frames q, k, v [T, heads, head_dim]: frame
    i attends to frames i - span + 1 .. i (span: relative's rows [span, heads, head_dim],
    one per distance), with logits q.k + q.relative[distance] soft-capped at `cap`;
    -> [T, heads * head_dim]."""
    frames, heads, span = q.shape[0], q.shape[1], relative.shape[0]
    index = torch.arange(frames)
    distance = index[:, None] - index[None, :]  # [query, key]
    allowed = (distance >= 0) & (distance < span)
    content = torch.einsum("qhd,khd->hqk", q, k)
    by_distance = torch.einsum("qhd,phd->hqp", q, relative)  # [heads, query, distance]
    gather = distance.clamp(0, span - 1).expand(heads, frames, frames)
    logits = content + by_distance.gather(-1, gather)
    logits = torch.tanh(logits / cap) * cap
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v.transpose(0, 1)  # [heads, query, head_dim]
    return out.transpose(0, 1).reshape(frames, -1)


class LightConv(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.clip = args.gradient_clipping
        hidden = args.hidden_size
        self.linear_start = ClippableLinear(args, hidden, hidden * 2)
        self.linear_end = ClippableLinear(args, hidden, hidden)
        self.depthwise_conv1d = nn.Conv1d(
            hidden, hidden, args.conv_kernel_size, groups=hidden, bias=False
        )
        self.pre_layer_norm = RMSNorm(hidden, args.rms_norm_eps)
        self.conv_norm = RMSNorm(hidden, args.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        # Causal: each frame sees the kernel's frames up to itself.
        h = F.pad(h.T[None], (self.depthwise_conv1d.kernel_size[0] - 1, 0))
        h = self.depthwise_conv1d(h)[0].T
        h = self.conv_norm(torch.clamp(h, -self.clip, self.clip))
        return x + self.linear_end(F.silu(h))


class ConformerLayer(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.clip = args.gradient_clipping
        self.feed_forward1 = FeedForward(args)
        self.feed_forward2 = FeedForward(args)
        self.self_attn = Attention(args)
        self.lconv1d = LightConv(args)
        self.norm_pre_attn = RMSNorm(args.hidden_size)
        self.norm_post_attn = RMSNorm(args.hidden_size)
        self.norm_out = RMSNorm(args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(torch.clamp(x, -self.clip, self.clip)))
        x = x + self.norm_post_attn(torch.clamp(h, -self.clip, self.clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -self.clip, self.clip))


class AudioTower(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.subsample_conv_projection = SubsampleConvProjection(args)
        self.layers = nn.ModuleList(ConformerLayer(args) for _ in range(args.num_hidden_layers))
        self.output_proj = nn.Linear(args.hidden_size, args.output_proj_dims, bias=True)


class AudioEmbedder(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.eps = args.rms_norm_eps
        self.embedding_projection = nn.Linear(
            args.output_proj_dims, args.text_hidden_size, bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(_rms(x, self.eps))


class AudioEncoder(nn.Module):
    """The audio tower and its embedder, under Gemma4Model's names."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.args = args
        self.audio_tower = AudioTower(args)
        self.embed_audio = AudioEmbedder(args)

    def forward(self, features: torch.Tensor, valid_frames: int) -> torch.Tensor:
        """Soft tokens [tokens, text hidden] of a clip's log-mel features [frames, mel
        bins] whose first `valid_frames` frames are its audio (the rest padding). The
        padding's positions come last and every later step looks back only, so they are
        cut after the convolutions."""
        tower = self.audio_tower
        mask = torch.arange(features.shape[0]) < valid_frames
        x, mask = tower.subsample_conv_projection(features, mask)
        x = x[: int(mask.sum())]
        for layer in tower.layers:
            x = layer(x)
        return self.embed_audio(tower.output_proj(x))
