"""Phi-4-multimodal's audio encoder: a clip's log-mel frames [T, 80] -> one soft token per 8
frames in the language model's width (its speech projection; prompts with images take the
other, which llmrun does not run).

The frames normalized by a global mean and inverse deviation, then NeMo's subsampling (a
3x3 stride-2 convolution, then depthwise 3x3 stride-2 and pointwise convolutions, ReLU
after each step) over time and frequency; Conformer blocks (half feed-forward, attention
with a learned bias per head and relative distance, a causal convolution module of GLU,
depthwise and pointwise convolutions, half feed-forward, LayerNorm), over windows of 500
subsampled frames where a clip is longer; then a GELU MLP.

transformers adds the blocks' chunk mask to the attention scores as 1 (seen) and 0 (not
seen) instead of masking: llmrun does the same. Phi-4-multimodal-instruct's chunk_size
of -1 lets every frame see every other, where that shift changes nothing.

Reference: transformers/models/phi4_multimodal/modeling_phi4_multimodal.py
(Phi4MultimodalAudioModel, Phi4MultimodalAudioEmbedding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation

# The most subsampled frames a window of the blocks takes (transformers' max_seq_len).
WINDOW = 500


@dataclass
class AudioArgs:
    """Phi4MultimodalAudioConfig's fields (its defaults, Phi-4-multimodal-instruct's)."""

    hidden_size: int = 1024
    intermediate_size: int = 1536
    num_blocks: int = 24
    num_attention_heads: int = 16
    activation: str = "swish"
    chunk_size: int = -1
    left_chunk: int = 18
    ext_pw_out_channel: int = 1024
    depthwise_separable_out_channel: int = 1024
    depthwise_multiplier: int = 1
    kernel_size: int = 3
    conv_activation: str = "swish"
    input_size: int = 80
    conv_glu_type: str = "swish"
    time_reduction: int = 8
    bias_max_distance: int = 1000
    bias_symmetric: bool = False
    nemo_activation: str = "relu"
    nemo_conv_channels: int = 1024
    downsample_rate: int = 1
    text_hidden_size: int = 3072

    def __post_init__(self) -> None:
        reduction = self.time_reduction
        if reduction < 2 or reduction & (reduction - 1):
            raise ModelFormatError(f"audio time_reduction {reduction} is not a power of 2")
        if self.downsample_rate != 1:
            raise ModelFormatError(
                f"audio downsample_rate {self.downsample_rate}: transformers' model runs only 1"
            )
        if self.ext_pw_out_channel != self.hidden_size or (
            self.depthwise_separable_out_channel != self.hidden_size
        ):
            raise ModelFormatError("audio convolution channels differ from its hidden_size")
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"audio hidden_size {self.hidden_size} is not a multiple of its "
                f"{self.num_attention_heads} heads"
            )
        for name in ("activation", "conv_activation", "conv_glu_type", "nemo_activation"):
            _act(getattr(self, name))  # refuses an unknown one

    @classmethod
    def from_config(cls, config: dict[str, Any], text_hidden_size: int) -> AudioArgs:
        """From a Phi4MultimodalConfig's audio_config dict."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        return cls(**{**values, "text_hidden_size": text_hidden_size})

    @property
    def frequency_bins(self) -> int:
        """The frequency bins left after the subsampling's stride-2 convolutions."""
        size = self.input_size
        for _ in range(int(math.log2(self.time_reduction))):
            size = math.floor((size - 1) / 2 + 1)
        return size


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return activation("silu" if name == "swish" else name)


class _Activation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = _act(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class MeanVarianceNorm(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.register_buffer("global_mean", torch.zeros(args.input_size))
        self.register_buffer("global_invstd", torch.ones(args.input_size))


class Subsampling(nn.Module):
    """NeMo's striding convolutions, with HF's indices (conv.0, conv.2, conv.3, ...)."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        channels = args.nemo_conv_channels
        layers: list[nn.Module] = [
            nn.Conv2d(1, channels, 3, stride=2, padding=1),
            _Activation(args.nemo_activation),
        ]
        for _ in range(int(math.log2(args.time_reduction)) - 1):
            layers += [
                nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels),
                nn.Conv2d(channels, channels, 1),
                _Activation(args.nemo_activation),
            ]
        self.conv = nn.Sequential(*layers)
        self.out = nn.Linear(channels * args.frequency_bins, args.hidden_size)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        # [B, T, freq] -> [B, channels, T', freq'] -> [B, T', channels * freq']
        x = self.conv(frames[:, None])
        return self.out(x.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(args.hidden_size)
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = _act(args.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.gate_up_proj(self.layer_norm(x)).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class Attention(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        # [B, T, dim] -> [B, heads, T, head_dim]
        q, k, v = (
            proj(x).view(batch, tokens, self.heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class GluPointWise(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        out = args.ext_pw_out_channel
        self.ext_pw_conv_1d = nn.Conv1d(args.hidden_size, 2 * out, 1)
        self.b1 = nn.Parameter(torch.zeros(1, out, 1))
        self.b2 = nn.Parameter(torch.zeros(1, out, 1))
        self.act = _act(args.conv_glu_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, channels, T] -> [B, out, T]."""
        value, gate = self.ext_pw_conv_1d(x).chunk(2, dim=1)
        return (value + self.b1) * self.act(gate + self.b2)


class DepthWiseSeparable(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        dim, wide = args.hidden_size, args.hidden_size * args.depthwise_multiplier
        size = args.kernel_size
        self.dw_conv = nn.Conv1d(dim, wide, size, padding=size - 1, groups=dim)
        self.pw_conv = nn.Conv1d(wide, args.depthwise_separable_out_channel, 1)


class ConvModule(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.kernel_size = args.kernel_size
        self.layer_norm = nn.LayerNorm(args.hidden_size)
        self.glu = GluPointWise(args)
        self.dw_sep_conv_1d = DepthWiseSeparable(args)
        self.ext_pw_conv_1d = nn.Conv1d(args.hidden_size, args.ext_pw_out_channel, 1)
        self.act = _act(args.conv_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, dim] -> [B, dim, T]; the depthwise convolution is causal: its padding's
        # last kernel_size - 1 frames dropped
        x = self.glu(self.layer_norm(x).transpose(1, 2))
        x = self.dw_sep_conv_1d.pw_conv(self.dw_sep_conv_1d.dw_conv(x))
        if self.kernel_size > 1:
            x = x[:, :, : -(self.kernel_size - 1)]
        return self.ext_pw_conv_1d(self.act(x)).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.feed_forward_in = FeedForward(args)
        self.self_attn = Attention(args)
        self.conv = ConvModule(args)
        self.feed_forward_out = FeedForward(args)
        self.layer_norm_att = nn.LayerNorm(args.hidden_size)
        self.layer_norm = nn.LayerNorm(args.hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward_in(x)
        x = x + self.self_attn(self.layer_norm_att(x), bias)
        x = x + self.conv(x)
        x = x + 0.5 * self.feed_forward_out(x)
        return self.layer_norm(x)


class RelativeBias(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.max_distance, self.symmetric = args.bias_max_distance, args.bias_symmetric
        buckets = self.max_distance * (1 if self.symmetric else 2)
        self.bias_values = nn.Embedding(buckets, args.num_attention_heads)

    def forward(self, tokens: int) -> torch.Tensor:
        """The bias [1, heads, T, T] of each head for key k seen from query q: by k - q,
        clipped to [-max_distance, max_distance - 1]."""
        positions = torch.arange(tokens)
        distance = (positions[None, :] - positions[:, None]).clamp(
            -self.max_distance, self.max_distance - 1
        )
        index = (
            distance.abs() if self.symmetric else distance + self.bias_values.num_embeddings // 2
        )
        return self.bias_values(index.to(self.bias_values.weight.device)).permute(2, 0, 1)[None]


def chunk_mask(tokens: int, chunk_size: int, left_chunks: int) -> torch.Tensor:
    """Which keys [T, T] each query sees (adaptive_enc_mask): its chunk of chunk_size and
    the left_chunks before it; every key where chunk_size is not positive."""
    if chunk_size <= 0:
        return torch.ones(tokens, tokens, dtype=torch.bool)
    chunk = torch.arange(tokens) // chunk_size
    behind = chunk[:, None] - chunk[None, :]
    return (behind >= 0) & (behind <= left_chunks)


class Encoder(nn.Module):
    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.args = args
        self.encoder_embedding = MeanVarianceNorm(args)
        self.embed = Subsampling(args)
        self.relative_attention_bias_layer = RelativeBias(args)
        self.encoders = nn.ModuleList(ConformerBlock(args) for _ in range(args.num_blocks))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """One clip's frames [T, freq] -> [ceil(T / time_reduction), hidden]."""
        norm = self.encoder_embedding
        x = self.embed(((frames - norm.global_mean) * norm.global_invstd)[None])
        tokens = x.shape[1]
        if tokens > WINDOW:
            # [1, T', dim] -> [windows, WINDOW, dim], the last one padded with zeros
            x = F.pad(x, (0, 0, 0, -tokens % WINDOW)).view(-1, WINDOW, x.shape[-1])
        length = x.shape[1]
        seen = chunk_mask(length, self.args.chunk_size, self.args.left_chunk).to(x.device)
        bias = self.relative_attention_bias_layer(length) + seen.to(x.dtype)
        for block in self.encoders:
            x = block(x, bias)
        return x.reshape(-1, x.shape[-1])[:tokens]


class AudioEncoder(nn.Module):
    """A clip's frames -> soft tokens [T', text hidden], with HF's module names
    (model.embed_tokens_extend.audio_embed.*)."""

    def __init__(self, args: AudioArgs) -> None:
        super().__init__()
        self.args = args
        self.encoder = Encoder(args)
        self.up_proj_for_speech = nn.Linear(args.hidden_size, args.text_hidden_size)
        self.down_proj_for_speech = nn.Linear(args.text_hidden_size, args.text_hidden_size)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = self.up_proj_for_speech(self.encoder(frames))
        return self.down_proj_for_speech(F.gelu(x))
