"""VibeVoice-ASR's audio encoder: 24 kHz samples [samples] -> tokens [samples / hop, text
hidden], one per hop (3200 samples, 133 ms, in the released model).

Two convolutional tokenizer encoders (acoustic and semantic, the same shape but for their
output width) read the waveform: a causal stem convolution and ConvNeXt-style layers (an
RMSNorm, a causal depthwise convolution scaled by gamma, an RMSNorm, an MLP scaled by
ffn_gamma, each around a residual), then per stage a causal strided convolution (kernel
twice the stride) and more such layers, then a causal head convolution to the latent
width. Each latent stream is projected (linear, RMSNorm, linear) to the language model's
width, and the two are summed. Every convolution is causal (left-padded), so the samples go
through in chunks, each convolution carrying its last inputs to the next chunk, and the
tokens are those of the whole clip.

The acoustic latents are the mean of a sigma-VAE: transformers adds noise to them unless
asked not to (sample=False); llmrun takes the mean, as sample=False does.

Reference: transformers/models/vibevoice_asr/modeling_vibevoice_asr.py
(VibeVoiceAsrModel.get_audio_features, VibeVoiceAsrMultiModalProjector) and
vibevoice_acoustic_tokenizer/modeling_vibevoice_acoustic_tokenizer.py
(VibeVoiceAcousticTokenizerEncoderModel, its stem, layers and ConvNext1dLayer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation

# Each causal convolution's last inputs, for the next chunk of the same clip.
Carry = dict[nn.Module, torch.Tensor]


@dataclass
class TokenizerArgs:
    """VibeVoiceAcousticTokenizerEncoderConfig's fields."""

    hidden_size: int = 64
    num_filters: int = 32
    downsampling_ratios: list[int] = field(default_factory=lambda: [2, 2, 4, 5, 5, 8])
    depths: list[int] = field(default_factory=lambda: [3, 3, 3, 3, 3, 3, 8])
    kernel_size: int = 7
    channels: int = 1
    ffn_expansion: int = 4
    rms_norm_eps: float = 1e-5
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        for name in ("downsampling_ratios", "depths"):
            if not isinstance(getattr(self, name), list | tuple):
                raise ModelFormatError(f"audio tokenizer {name} is {getattr(self, name)!r}")
        numbers = [self.hidden_size, self.num_filters, self.kernel_size, self.ffn_expansion]
        numbers += [*self.downsampling_ratios, *self.depths]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in numbers):
            raise ModelFormatError(f"an audio tokenizer encoder config with sizes {numbers}")
        if self.channels != 1:
            raise ModelFormatError(f"audio tokenizer channels {self.channels}: llmrun takes mono")
        if len(self.depths) != len(self.downsampling_ratios) + 1:
            raise ModelFormatError(
                f"audio tokenizer depths {self.depths}: one more than its "
                f"{len(self.downsampling_ratios)} downsampling_ratios"
            )
        activation(self.hidden_act)  # refuses an unknown one

    @property
    def hop_length(self) -> int:
        return math.prod(self.downsampling_ratios)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TokenizerArgs:
        return cls(**{k: config[k] for k in cls.__dataclass_fields__ if k in config})


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class CausalConv1d(nn.Module):
    """A convolution left-padded by kernel - stride: by the carried inputs of the chunk
    before, zeros at the clip's start."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, groups=groups)
        self.left = kernel - stride

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        before = carry.get(self)
        if before is None:
            before = x.new_zeros(x.shape[0], x.shape[1], self.left)
        padded = torch.cat([before, x], dim=-1)
        carry[self] = padded[..., padded.shape[-1] - self.left :]
        return self.conv(padded)


class FeedForward(nn.Module):
    def __init__(self, args: TokenizerArgs, width: int):
        super().__init__()
        self.linear1 = nn.Linear(width, args.ffn_expansion * width)
        self.activation = activation(args.hidden_act)
        self.linear2 = nn.Linear(args.ffn_expansion * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class ConvNextLayer(nn.Module):
    def __init__(self, args: TokenizerArgs, width: int):
        super().__init__()
        self.norm = RMSNorm(width, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(width, args.rms_norm_eps)
        self.ffn = FeedForward(args, width)
        self.gamma = nn.Parameter(torch.ones(width))
        self.ffn_gamma = nn.Parameter(torch.ones(width))
        self.mixer = CausalConv1d(width, width, args.kernel_size, groups=width)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        """[b, width, frames] -> the same."""
        mixed = self.mixer(self.norm(x.transpose(1, 2)).transpose(1, 2), carry)
        x = x + mixed * self.gamma[:, None]
        fed = self.ffn(self.ffn_norm(x.transpose(1, 2))).transpose(1, 2)
        return x + fed * self.ffn_gamma[:, None]


class Stage(nn.Module):
    """A convolution, then ConvNeXt layers at its output width."""

    def __init__(self, args: TokenizerArgs, conv: CausalConv1d, width: int, depth: int):
        super().__init__()
        self.conv = conv
        self.stage = nn.ModuleList(ConvNextLayer(args, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        x = self.conv(x, carry)
        for layer in self.stage:
            x = layer(x, carry)
        return x


class TokenizerEncoder(nn.Module):
    """VibeVoiceAcousticTokenizerEncoderModel: [b, 1, samples] -> latents [b, samples / hop,
    hidden]."""

    def __init__(self, args: TokenizerArgs):
        super().__init__()
        width = args.num_filters
        stem_conv = CausalConv1d(args.channels, width, args.kernel_size)
        self.stem = Stage(args, stem_conv, width, args.depths[0])
        layers = []
        for i, ratio in enumerate(args.downsampling_ratios):
            conv = CausalConv1d(width, 2 * width, 2 * ratio, stride=ratio)
            width *= 2
            layers.append(Stage(args, conv, width, args.depths[i + 1]))
        self.conv_layers = nn.ModuleList(layers)
        self.head = CausalConv1d(width, args.hidden_size, args.kernel_size)

    def forward(self, samples: torch.Tensor, carry: Carry) -> torch.Tensor:
        x = self.stem(samples, carry)
        for layer in self.conv_layers:
            x = layer(x, carry)
        return self.head(x, carry).transpose(1, 2)


@dataclass
class EncoderArgs:
    acoustic: TokenizerArgs
    semantic: TokenizerArgs
    text_hidden_size: int
    chunk_samples: int = 1440000  # acoustic_tokenizer_chunk_size: 60 seconds at 24 kHz

    def __post_init__(self) -> None:
        hop = self.acoustic.hop_length
        if self.semantic.hop_length != hop:
            raise ModelFormatError(
                f"the semantic tokenizer's hop ({self.semantic.hop_length} samples) is not the "
                f"acoustic one's ({hop})"
            )
        if (
            not isinstance(self.chunk_samples, int)
            or self.chunk_samples < hop
            or self.chunk_samples % hop
        ):
            raise ModelFormatError(
                f"acoustic_tokenizer_chunk_size {self.chunk_samples!r} is not a multiple of the "
                f"hop ({hop} samples)"
            )


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        width = args.text_hidden_size
        self.acoustic_linear_1 = nn.Linear(args.acoustic.hidden_size, width)
        self.acoustic_norm = RMSNorm(width, 1e-6)
        self.acoustic_linear_2 = nn.Linear(width, width)
        self.semantic_linear_1 = nn.Linear(args.semantic.hidden_size, width)
        self.semantic_norm = RMSNorm(width, 1e-6)
        self.semantic_linear_2 = nn.Linear(width, width)

    def forward(self, acoustic: torch.Tensor, semantic: torch.Tensor) -> torch.Tensor:
        a = self.acoustic_linear_2(self.acoustic_norm(self.acoustic_linear_1(acoustic)))
        s = self.semantic_linear_2(self.semantic_norm(self.semantic_linear_1(semantic)))
        return a + s


class VibeVoiceAsrEncoder(nn.Module):
    """The two tokenizer encoders and the projector, under VibeVoiceAsrModel's names."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.acoustic_tokenizer_encoder = TokenizerEncoder(args.acoustic)
        self.semantic_tokenizer_encoder = TokenizerEncoder(args.semantic)
        self.multi_modal_projector = Projector(args)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        """A clip's samples [a multiple of the hop] -> its tokens [samples / hop, text
        hidden], the samples taken a chunk at a time."""
        if samples.dim() != 1 or len(samples) % self.args.acoustic.hop_length:
            raise ValueError(f"audio samples of shape {list(samples.shape)}")
        acoustic_carry: Carry = {}
        semantic_carry: Carry = {}
        acoustic, semantic = [], []
        for chunk in torch.split(samples[None, None], self.args.chunk_samples, dim=-1):
            acoustic.append(self.acoustic_tokenizer_encoder(chunk, acoustic_carry))
            semantic.append(self.semantic_tokenizer_encoder(chunk, semantic_carry))
        return self.multi_modal_projector(torch.cat(acoustic, 1), torch.cat(semantic, 1))[0]
