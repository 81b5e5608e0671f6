"""GLM-ASR's audio encoder and projector: 30-second windows of log-mel features
[windows, mel bins, 3000] -> tokens [windows * 375, text hidden].

Whisper's two 1-D convolutions with GELU (the second halves the frames: 3000 -> 1500),
then pre-LayerNorm layers under Llama's names, without learned positions: attention (q, v
and out with biases, k without; grouped key/value heads where the config has fewer) turns
the first half of each head's dimensions by RoPE over the frame's position (halves of
that part paired, as transformers' permuted weights take it), a GELU MLP (fc1, fc2), a
final LayerNorm. Each 4 consecutive frames of a window are concatenated into one row
(intermediate_size wide), which linear-GELU-linear projects to one token.

Reference: transformers/models/glmasr/modeling_glmasr.py (GlmAsrEncoder, GlmAsrAttention,
apply_rotary_pos_emb, GlmAsrMultiModalProjector, GlmAsrModel.get_audio_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation

MERGE = 4  # frames a token takes (GlmAsrProcessor's merge_factor)
WINDOW_FRAMES = 3000  # mel frames of a 30-second window


@dataclass
class EncoderArgs:
    """GlmAsrEncoderConfig's fields, GlmAsrConfig's projector activation and the language
    model's width."""

    hidden_size: int
    intermediate_size: int  # the MLP's width, and the projector's input: MERGE frames
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    text_hidden_size: int
    num_mel_bins: int = 128
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    hidden_act: str = "gelu"
    projector_hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5  # nn.LayerNorm's default, which GlmAsrEncoder keeps

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "text_hidden_size",
            "num_mel_bins",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"audio {name} is {value!r}, not a positive number")
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"audio hidden_size {self.hidden_size} does not split into "
                f"{self.num_attention_heads} heads"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"audio num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.intermediate_size != MERGE * self.hidden_size:
            raise ModelFormatError(
                f"audio intermediate_size {self.intermediate_size} is not {MERGE} frames of "
                f"{self.hidden_size} (GLM-ASR's projector takes {MERGE} frames a token)"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelFormatError(
                f"audio partial_rotary_factor {self.partial_rotary_factor} turns "
                f"{self.rotary_dim} of a head's {self.head_dim} dimensions"
            )
        activation(self.hidden_act)  # refuses an unknown one
        activation(self.projector_hidden_act)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_config(cls, config: dict[str, Any], text_hidden: int) -> EncoderArgs:
        """From a GlmAsrConfig dict (its audio_config; GlmAsrEncoderConfig's defaults where
        it leaves fields out)."""
        audio = config["audio_config"]
        rope = audio.get("rope_parameters") or {}
        heads = audio.get("num_attention_heads", 20)
        return cls(
            hidden_size=audio.get("hidden_size", 1280),
            intermediate_size=audio.get("intermediate_size", 5120),
            num_hidden_layers=audio.get("num_hidden_layers", 32),
            num_attention_heads=heads,
            num_key_value_heads=audio.get("num_key_value_heads") or heads,
            text_hidden_size=text_hidden,
            num_mel_bins=audio.get("num_mel_bins", 128),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", audio.get("partial_rotary_factor", 0.5))
            ),
            hidden_act=audio.get("hidden_act") or "gelu",
            projector_hidden_act=config.get("projector_hidden_act") or "gelu",
        )


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, t, head_dim] with its first cos.shape[-1] dimensions turned, their
    halves paired."""
    dim = cos.shape[-1]
    turned, kept = x[..., :dim], x[..., dim:]
    first, second = turned.chunk(2, dim=-1)
    halves = torch.cat((-second, first), dim=-1)
    return torch.cat((turned * cos + halves * sin, kept), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        width, kv_width = args.hidden_size, args.num_key_value_heads * args.head_dim
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, kv_width, bias=False)
        self.v_proj = nn.Linear(width, kv_width)
        self.o_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        # [b, t, heads * head_dim] -> [b, heads, t, head_dim]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, width))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Tower(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        width = args.hidden_size
        self.args = args
        self.conv1 = nn.Conv1d(args.num_mel_bins, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = nn.LayerNorm(width, eps=args.layer_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[windows, mel bins, frames] -> [windows, frames / 2, hidden]."""
        x = F.gelu(self.conv1(features))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        dim = self.args.rotary_dim
        inv_freq = 1.0 / self.args.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float32) / dim
        )
        angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.linear_1 = nn.Linear(args.intermediate_size, 2 * args.text_hidden_size)
        self.linear_2 = nn.Linear(2 * args.text_hidden_size, args.text_hidden_size)
        self.act = activation(args.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class GlmAsrEncoder(nn.Module):
    """The tower and the projector, under GlmAsrModel's names."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.audio_tower = Tower(args)
        self.multi_modal_projector = Projector(args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Windows of log-mel features [windows, mel bins, WINDOW_FRAMES] -> every window's
        tokens [windows * WINDOW_FRAMES / 2 / MERGE, text hidden], in order."""
        if tuple(features.shape[1:]) != (self.args.num_mel_bins, WINDOW_FRAMES):
            raise ValueError(f"audio features of shape {list(features.shape)}")
        frames = self.audio_tower(features)
        # [windows, positions, hidden] -> [windows * positions / MERGE, MERGE * hidden]:
        # each row MERGE consecutive frames of one window.
        rows = frames.reshape(-1, self.args.intermediate_size)
        return self.multi_modal_projector(rows)
