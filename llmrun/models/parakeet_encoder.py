"""Nemotron 3 Nano Omni's audio encoder: Parakeet's FastConformer and the projector; a
clip's normalized log-mel frames -> one token per 8 frames, in the language model's width.

Three stride-2 convolutions (a plain one, then depthwise-separable ones) over time and mel
bins, each output past the clip's valid frames zeroed, then a linear layer; conformer
blocks (half a feed-forward, self-attention with Transformer-XL's relative positions and
content/position biases, a GLU + depthwise convolution + batch norm module, half a
feed-forward, a LayerNorm), the positions past the valid ones masked as keys (and their
query rows attending uniformly, as the all-masked rows of transformers' attention do);
an RMSNorm and a squared-ReLU MLP. One clip at a time, whose mask is the feature
extractor's (every frame but the last).

Reference: transformers/models/parakeet/modeling_parakeet.py (ParakeetEncoder) and
transformers/models/nemotron_h_omni/modeling_nemotron_h_omni.py (get_audio_features,
NemotronH_Omni_Reasoning_V3MultiModalProjector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm

PROJECTOR_EPS = 1e-5  # the projector's RMSNorm's


@dataclass
class EncoderArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    out_hidden_size: int  # the language model's width
    projection_hidden_size: int
    num_mel_bins: int = 80
    conv_kernel_size: int = 9
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    subsampling_conv_kernel_size: int = 3
    subsampling_conv_stride: int = 2
    attention_bias: bool = False
    convolution_bias: bool = True
    projection_bias: bool = True
    scale_input: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"audio hidden_size {self.hidden_size} is not {self.num_attention_heads} heads"
            )
        layers = math.log2(self.subsampling_factor)
        if self.subsampling_factor < 2 or layers != int(layers):
            raise UnsupportedError(f"audio subsampling_factor {self.subsampling_factor}")
        if self.subsampling_conv_stride != 2 or self.conv_kernel_size % 2 == 0:
            raise UnsupportedError(
                f"audio strides of {self.subsampling_conv_stride}, a convolution of "
                f"{self.conv_kernel_size} (llmrun runs strides of 2 and odd kernels)"
            )

    @classmethod
    def conformer(cls, encoder_config: dict[str, Any], defaults: dict[str, Any]) -> EncoderArgs:
        """A bare Conformer's (no projector): a ParakeetEncoderConfig's `encoder_config` over
        the `defaults` a model's config gives it (ParakeetEncoderConfig's names, hidden_act
        included)."""
        encoder = {**defaults, **encoder_config}
        if encoder["hidden_act"] != "silu":
            raise UnsupportedError(f"encoder hidden_act {encoder['hidden_act']!r} (silu runs)")
        heads = encoder.get("num_key_value_heads") or encoder["num_attention_heads"]
        if heads != encoder["num_attention_heads"]:
            raise UnsupportedError(f"encoder num_key_value_heads {heads!r} (llmrun runs MHA)")
        return cls(
            **{n: encoder[n] for n in defaults if n != "hidden_act"},
            # The Conformer alone runs: Nemotron Omni's projector fields mean nothing here.
            out_hidden_size=encoder["hidden_size"],
            projection_hidden_size=encoder["hidden_size"],
        )

    @property
    def subsampling_layers(self) -> int:
        return int(math.log2(self.subsampling_factor))

    def tokens(self, frames: int) -> int:
        """The positions `frames` mel frames subsample to (transformers'
        _get_subsampling_output_length)."""
        add = (self.subsampling_conv_kernel_size - 1) // 2 * 2 - self.subsampling_conv_kernel_size
        for _ in range(self.subsampling_layers):
            frames = (frames + add) // self.subsampling_conv_stride + 1
        return frames


class Subsampling(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        k, s, c = (
            args.subsampling_conv_kernel_size,
            args.subsampling_conv_stride,
            args.subsampling_conv_channels,
        )
        layers: list[nn.Module] = [nn.Conv2d(1, c, k, stride=s, padding=(k - 1) // 2), nn.ReLU()]
        for _ in range(args.subsampling_layers - 1):
            layers.append(nn.Conv2d(c, c, k, stride=s, padding=(k - 1) // 2, groups=c))
            layers.append(nn.Conv2d(c, c, kernel_size=1))
            layers.append(nn.ReLU())
        self.layers = nn.ModuleList(layers)
        bins = args.num_mel_bins // s**args.subsampling_layers
        self.linear = nn.Linear(c * bins, args.hidden_size)

    def forward(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        """[frames, mel] -> [positions, hidden], each convolution's output past the valid
        frames zeroed."""
        x = features[None, None]  # [1, 1, T, mel]
        for layer in self.layers:
            x = layer(x)
            if isinstance(layer, nn.Conv2d):
                if layer.stride != (1, 1):
                    pad, k, s = layer.padding[0], layer.kernel_size[0], layer.stride[0]
                    valid = (valid + 2 * pad - k) // s + 1
                x[:, :, valid:] = 0
        # [1, C, T', bins] -> [T', C * bins]
        return self.linear(x[0].transpose(0, 1).reshape(x.shape[2], -1))


def relative_positions(length: int, hidden: int) -> torch.Tensor:
    """The sinusoids [2 * length - 1, hidden] of relative positions length - 1 .. 1 - length,
    sin and cos interleaved."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hidden, 2, dtype=torch.float) / hidden))
    freqs = torch.arange(length - 1, -length, -1).float()[:, None] * inv_freq
    return torch.stack([freqs.sin(), freqs.cos()], dim=-1).reshape(2 * length - 1, hidden)


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        hidden, heads = args.hidden_size, args.num_attention_heads
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=args.attention_bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=args.attention_bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=args.attention_bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=args.attention_bias)
        self.relative_k_proj = nn.Linear(hidden, hidden, bias=False)
        self.bias_u = nn.Parameter(torch.empty(heads, hidden // heads))
        self.bias_v = nn.Parameter(torch.empty(heads, hidden // heads))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]
        # [T, C] -> [heads, T, head_dim]
        q, k, v = (
            p(x).view(length, self.heads, -1).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scale = q.shape[-1] ** -0.5
        # [2T - 1, C] -> [heads, head_dim, 2T - 1]
        relative = self.relative_k_proj(positions).view(-1, self.heads, q.shape[-1])
        by_position = (q + self.bias_v[:, None]) @ relative.permute(1, 2, 0)
        # Transformer-XL's shift: row i's scores for relative positions T-1-i .. -i.
        width = by_position.shape[-1]
        shifted = F.pad(by_position, (1, 0)).view(self.heads, -1, length)[:, 1:]
        by_position = shifted.reshape(self.heads, length, width)[..., :length] * scale
        by_position = by_position.masked_fill(~mask, torch.finfo(by_position.dtype).min)
        out = F.scaled_dot_product_attention(q + self.bias_u[:, None], k, v, attn_mask=by_position)
        return self.o_proj(out.transpose(0, 1).reshape(length, -1))


class FeedForward(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.linear1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.attention_bias)
        self.linear2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.attention_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.silu(self.linear1(x)))


class Convolution(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        c, k, bias = args.hidden_size, args.conv_kernel_size, args.convolution_bias
        self.pointwise_conv1 = nn.Conv1d(c, 2 * c, 1, bias=bias)
        self.depthwise_conv = nn.Conv1d(c, c, k, padding=(k - 1) // 2, groups=c, bias=bias)
        self.norm = nn.BatchNorm1d(c)
        self.pointwise_conv2 = nn.Conv1d(c, c, 1, bias=bias)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.pointwise_conv1(x.T[None]), dim=1)  # [1, C, T]
        h = h.masked_fill(~valid, 0.0)
        h = F.silu(self.norm(self.depthwise_conv(h)))
        return self.pointwise_conv2(h)[0].T


class Block(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        c = args.hidden_size
        self.feed_forward1 = FeedForward(args)
        self.self_attn = Attention(args)
        self.conv = Convolution(args)
        self.feed_forward2 = FeedForward(args)
        self.norm_feed_forward1 = nn.LayerNorm(c)
        self.norm_self_att = nn.LayerNorm(c)
        self.norm_conv = nn.LayerNorm(c)
        self.norm_feed_forward2 = nn.LayerNorm(c)
        self.norm_out = nn.LayerNorm(c)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        mask = valid[:, None] & valid[None, :]
        x = x + self.self_attn(self.norm_self_att(x), positions, mask)
        x = x + self.conv(self.norm_conv(x), valid)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class Conformer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.subsampling = Subsampling(args)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_hidden_layers))

    def forward(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        x = self.subsampling(features, valid)
        if self.args.scale_input:
            x = x * math.sqrt(self.args.hidden_size)
        positions = relative_positions(x.shape[0], self.args.hidden_size).to(x.device, x.dtype)
        kept = torch.arange(x.shape[0], device=x.device) < self.args.tokens(valid)
        for layer in self.layers:
            x = layer(x, positions, kept)
        return x


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        bias = args.projection_bias
        self.layer_norm = RMSNorm(args.hidden_size, PROJECTOR_EPS)
        self.linear_1 = nn.Linear(args.hidden_size, args.projection_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(args.projection_hidden_size, args.out_hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(torch.relu(self.linear_1(self.layer_norm(x))).square())


class AudioEncoder(nn.Module):
    """The conformer and the projector, under transformers' module names."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.audio_tower = Conformer(args)
        self.embed_audio = Projector(args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """A clip's tokens [tokens, out_hidden] from its features [frames, mel] (the last
        frame outside the mask, as the feature extractor gives them): as many as the
        processor counts for the clip (its frames subsampled)."""
        frames = features.shape[0]
        out = self.embed_audio(self.audio_tower(features, frames - 1))
        return out[: self.args.tokens(frames)]
