"""OmniASR's audio encoder (Meta's Omnilingual ASR, OmniASRForConditionalGeneration): a
clip's normalized 16 kHz samples -> wav2vec 2.0's layer-normalized strided convolutions
(one frame per 320 samples in the released models) -> a LayerNorm and a projection -> a
grouped convolution's relative positions (its last output dropped, GELU) added ->
pre-LayerNorm Transformer layers and a final LayerNorm -> a linear projector to the
language model's width: one token per frame. One clip at a time, unpadded.

The pieces are wav2vec 2.0's "layer" / stable-layer-norm ones (llmrun.models.wav2vec2),
under transformers' OmniASR names; the positional convolution holds its weight as is (no
weight norm).

Reference: transformers/models/omniasr/modular_omniasr.py (OmniASRAudioModel,
OmniASRModel.get_audio_features).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import wav2vec2


@dataclass
class EncoderArgs:
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    conv_dim: list[int] = field(default_factory=lambda: [512] * 7)
    conv_kernel: list[int] = field(default_factory=lambda: [10, 3, 3, 3, 3, 2, 2])
    conv_stride: list[int] = field(default_factory=lambda: [5, 2, 2, 2, 2, 2, 2])
    conv_bias: bool = True
    num_conv_pos_embeddings: int = 128
    num_conv_pos_embedding_groups: int = 16
    text_hidden_size: int = 4096  # the projector's output: the language model's width

    def __post_init__(self) -> None:
        # OmniASR drops the positional convolution's last output whatever its kernel: an
        # odd one would leave one position fewer than the input, which transformers fails on.
        if self.num_conv_pos_embeddings % 2:
            raise ModelFormatError(
                f"num_conv_pos_embeddings {self.num_conv_pos_embeddings}: OmniASR's positional "
                "convolution takes an even kernel"
            )
        self.wav2vec2 = wav2vec2.ModelArgs(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            layer_norm_eps=self.layer_norm_eps,
            feat_extract_norm="layer",
            feat_extract_activation=self.hidden_act,
            conv_dim=list(self.conv_dim),
            conv_stride=list(self.conv_stride),
            conv_kernel=list(self.conv_kernel),
            conv_bias=self.conv_bias,
            num_conv_pos_embeddings=self.num_conv_pos_embeddings,
            num_conv_pos_embedding_groups=self.num_conv_pos_embedding_groups,
            do_stable_layer_norm=True,
        )

    @classmethod
    def from_config(cls, audio: dict[str, Any], text_hidden_size: int = 4096) -> EncoderArgs:
        names = set(cls.__dataclass_fields__) - {"text_hidden_size"}
        fields = {k: v for k, v in audio.items() if k in names and v is not None}
        return cls(**fields, text_hidden_size=text_hidden_size)

    def frames(self, samples: int) -> int:
        """The tokens `samples` samples convolve to (OmniASRProcessor's count)."""
        return self.wav2vec2.frames(samples)


class Subsampling(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        inner = args.wav2vec2
        self.conv_layers = nn.ModuleList(
            wav2vec2.ConvLayer(inner, i) for i in range(len(args.conv_dim))
        )
        self.layer_norm = nn.LayerNorm(args.conv_dim[-1], eps=args.layer_norm_eps)
        self.projection = nn.Linear(args.conv_dim[-1], args.hidden_size)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        x = samples[None, None]  # [1, 1, samples]
        for layer in self.conv_layers:
            x = layer(x)
        return self.projection(self.layer_norm(x[0].T))  # [frames, hidden]


class AudioTower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.subsampling = Subsampling(args)
        self.encode_positions = wav2vec2.PositionalConv(args.wav2vec2)
        self.layers = nn.ModuleList(
            wav2vec2.EncoderLayer(args.wav2vec2, i) for i in range(args.num_hidden_layers)
        )
        self.layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        x = self.subsampling(samples)
        x = x + self.encode_positions(x)
        for layer in self.layers:
            x, _ = layer(x, None)  # no relative position bias (WavLM's alone)
        return self.layer_norm(x)


class OmniASREncoder(nn.Module):
    """The tower and projector under OmniASRModel's names: a clip's token embeddings."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.audio_tower = AudioTower(args)
        self.multi_modal_projector = nn.Linear(args.hidden_size, args.text_hidden_size)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        """The embeddings [frames, text hidden] of a clip's normalized samples [samples]."""
        return self.multi_modal_projector(self.audio_tower(samples))
