"""Voxtral Realtime: a causal Whisper-style audio encoder whose tokens are added to the text
tokens position by position, under a Mistral whose MLPs are conditioned on the transcription
delay. Not a prompt of audio places: the token at position p reads audio token p, the
prompt's and the generated ones' alike, so it transcribes as it listens
(llmrun.voxtral_realtime decodes it).

Encoder: two causal 1-D convolutions with GELU (the second halves the 10 ms frames), then
pre-RMSNorm layers whose attention (q, v and out with biases, k without; RoPE) is causal
within a sliding window, a SiLU-gated MLP (its down projection with a bias), a final
RMSNorm. Each 4 consecutive frames are concatenated into one row, which linear-GELU-linear
(no biases) projects to one token: 12.5 a second. Text: Mistral's layers, their
post-attention RMSNorm's output scaled by 1 + a small MLP of the delay's sinusoidal
embedding (cosines then sines), causal attention within a sliding window; the output head
tied to the embedding.

Reference: transformers/models/voxtral_realtime/modeling_voxtral_realtime.py
(VoxtralRealtimeEncoder, VoxtralRealtimeTextModel, VoxtralRealtimeTimeEmbedding,
VoxtralRealtimeModel.get_audio_features).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import activation

ADA_WIDTH = 32  # VoxtralRealtimeTextAdaRmsNorm's bottleneck


@dataclass
class StackArgs:
    """One transformer stack's fields (VoxtralRealtimeEncoderConfig's or
    VoxtralRealtimeTextConfig's)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int | None
    rope_theta: float
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"Voxtral Realtime {name} is {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"Voxtral Realtime num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ModelFormatError(f"Voxtral Realtime sliding_window is {window!r}")
        activation(self.hidden_act)  # refuses an unknown one

    @classmethod
    def of(cls, config: dict[str, Any], defaults: dict[str, Any], kv_heads: bool) -> StackArgs:
        values = {**defaults, **{k: v for k, v in config.items() if v is not None}}
        heads = values["num_attention_heads"]
        rope = values.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedError(f"Voxtral Realtime RoPE type {rope.get('rope_type')!r}")
        return cls(
            hidden_size=values["hidden_size"],
            intermediate_size=values["intermediate_size"],
            num_hidden_layers=values["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=values.get("num_key_value_heads", heads) if kv_heads else heads,
            head_dim=values.get("head_dim") or values["hidden_size"] // heads,
            sliding_window=values.get("sliding_window"),
            rope_theta=float(rope.get("rope_theta", values.get("rope_theta", 10000.0))),
            rms_norm_eps=float(values.get("rms_norm_eps", 1e-5)),
            hidden_act=values.get("hidden_act", "silu"),
        )


# VoxtralRealtimeEncoderConfig's defaults, and the text_config VoxtralRealtimeConfig makes.
AUDIO_DEFAULTS = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": 64,
    "sliding_window": 750,
    "num_mel_bins": 128,
}
TEXT_DEFAULTS = {
    "vocab_size": 131072,
    "hidden_size": 3072,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "sliding_window": 8192,
    "tie_word_embeddings": True,
}


@dataclass
class ModelArgs:
    """VoxtralRealtimeConfig's fields."""

    audio: StackArgs
    text: StackArgs
    vocab_size: int
    num_mel_bins: int = 128
    downsample_factor: int = 4
    audio_length_per_tok: int = 8
    default_num_delay_tokens: int = 6
    projector_hidden_act: str = "gelu"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        audio = {**AUDIO_DEFAULTS, **(config.get("audio_config") or {})}
        text = {**TEXT_DEFAULTS, **(config.get("text_config") or {})}
        if not (config.get("tie_word_embeddings", True) or text.get("tie_word_embeddings")):
            raise UnsupportedError(
                "a Voxtral Realtime config with tie_word_embeddings false: llmrun ties its "
                "output head to the embedding, as the released models do"
            )
        args = cls(
            audio=StackArgs.of(audio, {}, kv_heads=False),
            text=StackArgs.of(text, {}, kv_heads=True),
            vocab_size=text["vocab_size"],
            num_mel_bins=audio["num_mel_bins"],
            downsample_factor=config.get("downsample_factor", 4),
            audio_length_per_tok=config.get("audio_length_per_tok", 8),
            default_num_delay_tokens=config.get("default_num_delay_tokens", 6),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
        )
        if args.audio_length_per_tok != 2 * args.downsample_factor:
            raise ModelFormatError(
                f"Voxtral Realtime audio_length_per_tok {args.audio_length_per_tok} is not the "
                f"encoder's 2 x downsample_factor {args.downsample_factor} mel frames"
            )
        activation(args.projector_hidden_act)
        return args


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(positions: torch.Tensor, args: StackArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] of the positions, halves paired."""
    dim = args.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    inv = 1.0 / args.rope_theta ** (steps / dim)
    angles = positions.float()[:, None] * inv
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _turned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def window_mask(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query attends to [queries, keys]: those at or before it, fewer than
    `window` back."""
    back = queries[:, None] - keys[None, :]
    allowed = back >= 0
    return allowed if window is None else allowed & (back < window)


class Attention(nn.Module):
    def __init__(self, args: StackArgs, biases: bool):
        super().__init__()
        self.args = args
        heads, kv, dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, heads * dim, bias=biases)
        self.k_proj = nn.Linear(args.hidden_size, kv * dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv * dim, bias=biases)
        self.o_proj = nn.Linear(heads * dim, args.hidden_size, bias=biases)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [t, width] at `positions` -> [t, width]. `keys`: a cache (Model.new_keys) this
        writes `positions` to and attends to the rows of; None: the t rows attend among
        themselves, in blocks of queries a window long (a long clip's scores never held
        whole)."""
        args = self.args
        t = x.shape[0]
        # [t, heads * head_dim] -> [heads, t, head_dim]
        q = self.q_proj(x).view(t, -1, args.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(t, -1, args.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(t, -1, args.head_dim).transpose(0, 1)
        cos, sin = rope(positions, args)
        q, k = _turned(q, cos, sin), _turned(k, cos, sin)
        if keys is not None:
            cached_k, cached_v = keys
            size, last = cached_k.shape[1], int(positions[-1])
            if t > 1 and last >= size:
                raise ValueError(f"positions up to {last} in one forward through a cache of {size}")
            # A ring of `size` rows: position p in row p % size (a window's worth suffices).
            cached_k[:, positions % size] = k
            cached_v[:, positions % size] = v
            count = min(last + 1, size)
            held = last - (last - torch.arange(count, device=x.device)) % size
            mask = window_mask(positions, held, args.sliding_window)
            out = self._attend(q, cached_k[:, :count], cached_v[:, :count], mask)
        else:
            block = args.sliding_window or t
            pieces = []
            for start in range(0, t, block):
                end = min(t, start + block)
                first = max(0, start - block + 1) if args.sliding_window else 0
                mask = window_mask(positions[start:end], positions[first:end], args.sliding_window)
                pieces.append(self._attend(q[:, start:end], k[:, first:end], v[:, first:end], mask))
            out = torch.cat(pieces, dim=1)
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        groups = self.args.num_attention_heads // self.args.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    def __init__(self, args: StackArgs, down_bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=down_bias)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, args: StackArgs):
        super().__init__()
        self.self_attn = Attention(args, biases=True)
        self.self_attn_layer_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.final_layer_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, down_bias=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), positions)
        return x + self.mlp(self.final_layer_norm(x))


class Embedder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.audio.hidden_size
        self.conv1 = nn.Conv1d(args.num_mel_bins, width, kernel_size=3)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[mel bins, frames] -> [frames / 2, width], each output from its frames and the
        ones before (left-padded by kernel - stride)."""
        x = F.gelu(self.conv1(F.pad(features[None], (2, 0))))
        return F.gelu(self.conv2(F.pad(x, (1, 0))))[0].T


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embedder = Embedder(args)
        self.layers = nn.ModuleList(
            EncoderLayer(args.audio) for _ in range(args.audio.num_hidden_layers)
        )
        self.norm = RMSNorm(args.audio.hidden_size, args.audio.rms_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.embedder(features)
        positions = torch.arange(x.shape[0], device=x.device)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class Projector(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.text.hidden_size
        self.linear_1 = nn.Linear(
            args.audio.hidden_size * args.downsample_factor, width, bias=False
        )
        self.act = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class AdaNorm(nn.Module):
    """VoxtralRealtimeTextAdaRmsNorm: the delay's embedding -> the MLP input's scale - 1."""

    def __init__(self, width: int):
        super().__init__()
        self.linear1 = nn.Linear(width, ADA_WIDTH, bias=False)
        self.linear2 = nn.Linear(ADA_WIDTH, width, bias=False)

    def forward(self, delay: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(delay)))


class DecoderLayer(nn.Module):
    def __init__(self, args: StackArgs):
        super().__init__()
        self.self_attn = Attention(args, biases=False)
        self.mlp = MLP(args, down_bias=False)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ada_rms_norm = AdaNorm(args.hidden_size)

    def forward(self, x, positions, keys, delay) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, keys)
        scaled = self.post_attention_layernorm(x) * (1 + self.ada_rms_norm(delay))
        return x + self.mlp(scaled)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.text.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(args.text) for _ in range(args.text.num_hidden_layers)
        )
        self.norm = RMSNorm(args.text.hidden_size, args.text.rms_norm_eps)


def delay_embedding(delay_tokens: int, width: int) -> torch.Tensor:
    """VoxtralRealtimeTimeEmbedding of the delay [width]: cosines, then sines."""
    inv = torch.exp(-math.log(10000.0) * torch.arange(width // 2).float() / (width // 2))
    angles = delay_tokens * inv
    return torch.cat((angles.cos(), angles.sin()))


class Model(nn.Module):
    """VoxtralRealtimeForConditionalGeneration without its generate: `encode` a clip's
    features once, then `step` ids with their audio tokens added (llmrun.voxtral_realtime)."""

    generates = False  # not through llmrun's decoder-only loop
    transcribes = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.audio_tower = Encoder(args)
        self.multi_modal_projector = Projector(args)
        self.model = Decoder(args)
        self.lm_head = nn.Linear(args.text.hidden_size, args.vocab_size, bias=False)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel features [mel bins, frames: a multiple of audio_length_per_tok] -> the
        audio tokens [frames / audio_length_per_tok, text hidden]."""
        if features.dim() != 2 or features.shape[1] % self.args.audio_length_per_tok:
            raise ValueError(f"audio features of shape {list(features.shape)}")
        frames = self.audio_tower(features)
        # [frames, width] -> [frames / downsample, downsample * width]: consecutive frames
        rows = frames.reshape(-1, self.args.audio.hidden_size * self.args.downsample_factor)
        return self.multi_modal_projector(rows)

    def new_keys(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's key and value cache for `length` positions (rows for the
        sliding window's, where it is shorter)."""
        text = self.args.text
        rows = length if text.sliding_window is None else min(length, text.sliding_window)
        shape = (text.num_key_value_heads, rows, text.head_dim)
        weight = self.model.norm.weight
        return [
            (weight.new_zeros(shape), weight.new_zeros(shape))
            for _ in range(text.num_hidden_layers)
        ]

    def step(
        self,
        ids: torch.Tensor,
        audio: torch.Tensor,
        positions: torch.Tensor,
        keys: list[tuple[torch.Tensor, torch.Tensor]],
        delay: torch.Tensor,
    ) -> torch.Tensor:
        """The logits [t, vocab] of ids [t] at `positions`, their audio tokens [t, hidden]
        added to their embeddings, through the caches `keys`; `delay`: delay_embedding's."""
        x = self.model.embed_tokens(ids) + audio
        for layer, cache in zip(self.model.layers, keys, strict=True):
            x = layer(x, positions, cache, delay)
        return self.lm_head(self.model.norm(x))
