"""Fun-ASR-Nano's audio encoder and adaptor: low-frame-rate fbank features [frames, mel
bins * stacked frames] -> tokens [frames, text hidden], one per 60 ms frame.

The encoder is SenseVoice's SAN-M: the features scaled by the square root of the width
plus sinusoidal positions counted from one, then pre-LayerNorm layers whose attention (q,
k, v, out, all with biases) adds an FSMN memory (a depthwise convolution over the values,
plus the values) to its output; the first layer takes the stacked features (no residual
around its attention, whose input is wider), and the last transcription layer and the
last layer of all add a LayerNorm. The adaptor projects (linear, activation, linear) to
the language model's width and runs its own layers, without FSMN.

Reference: transformers/models/fun_asr_nano/modeling_fun_asr_nano.py (FunAsrNanoEncoder,
FunAsrNanoEncoderLayer, FunAsrNanoAttention, FunAsrNanoFSMN, FunAsrNanoPositionEmbedding,
FunAsrNanoMultiModalProjector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation


@dataclass
class EncoderArgs:
    """FunAsrNanoEncoderConfig's and FunAsrNanoAdaptorConfig's fields (adaptor_*)."""

    hidden_size: int = 512
    num_attention_heads: int = 4
    intermediate_size: int = 2048
    num_hidden_layers: int = 70
    num_timestamp_prediction_layers: int = 20
    num_mel_bins: int = 80
    num_stacked_frames: int = 7
    max_position_embeddings: int = 2049
    fsmn_kernel_size: int = 11
    hidden_act: str = "relu"
    layer_norm_eps: float = 1e-5
    adaptor_hidden_size: int = 1024  # the language model's width
    adaptor_num_attention_heads: int = 8
    adaptor_intermediate_size: int = 256
    adaptor_num_hidden_layers: int = 2
    adaptor_hidden_act: str = "relu"
    adaptor_layer_norm_eps: float = 1e-5
    projector_hidden_size: int = 2048
    projector_hidden_act: str = "relu"

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name.endswith(("_act", "_eps")):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelFormatError(f"audio {name} is {value!r}, not a number of at least 0")
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_mel_bins"):
            if getattr(self, name) < 1:
                raise ModelFormatError(f"audio {name} is 0")
        if self.num_timestamp_prediction_layers >= self.num_hidden_layers:
            raise ModelFormatError(
                f"audio num_timestamp_prediction_layers {self.num_timestamp_prediction_layers} "
                f"leaves none of the {self.num_hidden_layers} layers for transcription"
            )
        for width, heads, what in (
            (self.hidden_size, self.num_attention_heads, "hidden_size"),
            (self.adaptor_hidden_size, self.adaptor_num_attention_heads, "adaptor hidden_size"),
        ):
            if heads < 1 or width % heads:
                raise ModelFormatError(f"audio {what} {width} does not split into {heads} heads")
        if self.input_size % 2:
            raise ModelFormatError(f"audio features of {self.input_size} (odd) channels")
        if self.fsmn_kernel_size < 1:
            raise ModelFormatError("audio fsmn_kernel_size is 0")
        for name in ("hidden_act", "adaptor_hidden_act", "projector_hidden_act"):
            activation(getattr(self, name))  # refuses an unknown one

    @property
    def input_size(self) -> int:
        return self.num_mel_bins * self.num_stacked_frames

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a FunAsrNanoConfig dict (its audio_config and adaptor_config; their
        classes' defaults where it leaves fields out)."""
        audio = config.get("audio_config") or {}
        adaptor = config.get("adaptor_config") or {}
        fields = {k: audio[k] for k in cls.__dataclass_fields__ if k in audio}
        for key, value in adaptor.items():
            name = key if key.startswith("projector_") else f"adaptor_{key}"
            if name in cls.__dataclass_fields__:
                fields[name] = value
        return cls(**fields)


class Attention(nn.Module):
    def __init__(self, width_in: int, width: int, heads: int, fsmn_kernel: int | None):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q_proj = nn.Linear(width_in, width)
        self.k_proj = nn.Linear(width_in, width)
        self.v_proj = nn.Linear(width_in, width)
        self.o_proj = nn.Linear(width, width)
        self.fsmn = FSMN(width, fsmn_kernel) if fsmn_kernel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        values = self.v_proj(x)
        # [b, t, heads * head_dim] -> [b, heads, t, head_dim]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = values.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return out if self.fsmn is None else out + self.fsmn(values)


class FSMN(nn.Module):
    """A depthwise convolution over time of the (unsplit) values, plus the values."""

    def __init__(self, width: int, kernel: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel, groups=width, bias=False)
        left = (kernel - 1) // 2
        self.pad = (left, kernel - 1 - left)

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        memory = self.conv(F.pad(values.transpose(1, 2), self.pad)).transpose(1, 2)
        return memory + values


class MLP(nn.Module):
    def __init__(self, width: int, inner: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(width, inner)
        self.fc2 = nn.Linear(inner, width)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """An encoder layer (`fsmn_kernel`) or an adaptor layer (None); `width_in` wider than
    `width` (the first encoder layer's): no residual around its attention."""

    def __init__(
        self,
        width_in: int,
        width: int,
        heads: int,
        inner: int,
        act: str,
        eps: float,
        fsmn_kernel: int | None,
        final_norm: bool = False,
    ):
        super().__init__()
        self.residual = width_in == width
        self.self_attn = Attention(width_in, width, heads, fsmn_kernel)
        self.mlp = MLP(width, inner, act)
        self.input_layernorm = nn.LayerNorm(width_in, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(width, eps=eps)
        self.final_layernorm = nn.LayerNorm(width, eps=eps) if final_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x))
        x = x + attended if self.residual else attended
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x if self.final_layernorm is None else self.final_layernorm(x)


def positions(length: int, channels: int) -> torch.Tensor:
    """FunAsrNanoPositionEmbedding's table [length, channels]: sines then cosines."""
    step = math.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2).float())
    angles = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


class Tower(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        normed = (args.num_hidden_layers - args.num_timestamp_prediction_layers - 1,)
        normed += (args.num_hidden_layers - 1,)
        self.layers = nn.ModuleList(
            EncoderLayer(
                args.input_size if i == 0 else args.hidden_size,
                args.hidden_size,
                args.num_attention_heads,
                args.intermediate_size,
                args.hidden_act,
                args.layer_norm_eps,
                args.fsmn_kernel_size,
                final_norm=i in normed,
            )
            for i in range(args.num_hidden_layers)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[1, frames, input size] -> [1, frames, hidden]."""
        frames = features.shape[1]
        # Counted from one, as FunASR's SinusoidalPositionEncoder counts them.
        table = positions(frames + 1, self.args.input_size)[1:]
        x = features * self.args.hidden_size**0.5 + table
        for layer in self.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        width = args.adaptor_hidden_size
        self.linear_1 = nn.Linear(args.hidden_size, args.projector_hidden_size)
        self.act = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(args.projector_hidden_size, width)
        self.layers = nn.ModuleList(
            EncoderLayer(
                width,
                width,
                args.adaptor_num_attention_heads,
                args.adaptor_intermediate_size,
                args.adaptor_hidden_act,
                args.adaptor_layer_norm_eps,
                None,
            )
            for _ in range(args.adaptor_num_hidden_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(self.act(self.linear_1(x)))
        for layer in self.layers:
            x = layer(x)
        return x


class FunAsrNanoEncoder(nn.Module):
    """The tower and the adaptor, under FunAsrNanoModel's names."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.audio_tower = Tower(args)
        self.multi_modal_projector = Projector(args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """One clip's features [frames, input size] -> its tokens [frames, text hidden]."""
        if features.dim() != 2 or features.shape[1] != self.args.input_size:
            raise ValueError(f"audio features of shape {list(features.shape)}")
        return self.multi_modal_projector(self.audio_tower(features[None]))[0]
