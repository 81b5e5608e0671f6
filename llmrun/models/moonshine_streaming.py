"""Moonshine Streaming (MoonshineStreamingForConditionalGeneration): speech recognition by
an encoder-decoder over raw 16 kHz audio. The encoder cuts the samples into 5 ms frames
(80 samples), each centered and scaled to unit RMS, compressed by asinh(k x) (k learned),
embedded by a linear layer and SiLU, then two causal 1-D convolutions (5 taps, stride 2;
SiLU between): one position per 20 ms. Its layers are pre-LayerNorm (no bias; scale
1 + gamma) bidirectional attention without positions, grouped keys and values, each layer
attending within its own sliding window (so many positions back, so many ahead) where the
feature extractor returns an attention mask (everywhere where it does not, as transformers
attends then), and a GELU MLP; a final such LayerNorm. The decoder is Moonshine's
(llmrun.models.moonshine: RoPE on part of each head, gated SiLU MLP), attending to the
encoder's output plus learned positions, projected to its width where the two differ.

Reference: transformers/models/moonshine_streaming/modeling_moonshine_streaming.py
(MoonshineStreamingEncoderEmbedder, MoonshineStreamingEncoder, sliding_window_mask_function,
MoonshineStreamingDecoder).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import moonshine
from llmrun.models.base import activation, rope_parameters
from llmrun.models.moonshine import CrossCache, Decoder

FRAME = 80  # samples in a 5 ms frame at 16 kHz
CONV_KERNEL, CONV_STRIDE = 5, 2
CMVN_EPS = 1e-6
# MoonshineStreamingEncoderConfig's defaults.
ENCODER_DEFAULTS: dict[str, Any] = dict(
    hidden_size=320,
    intermediate_size=1280,
    hidden_act="gelu",
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    attention_bias=False,
    sample_rate=16000,
    frame_ms=5.0,
    sliding_windows=[[16, 4], [16, 4], [16, 0], [16, 0], [16, 4], [16, 4]],
    head_dim=None,
)


@dataclass
class EncoderArgs:
    """A MoonshineStreamingEncoderConfig's fields, by its names."""

    hidden_size: int
    intermediate_size: int
    hidden_act: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    attention_bias: bool
    sample_rate: int
    frame_ms: float
    sliding_windows: list[list[int]]
    head_dim: int | None

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"encoder: {self.num_attention_heads} attention heads do not group into "
                f"{self.num_key_value_heads} key/value heads"
            )
        if round(self.sample_rate * self.frame_ms / 1000) != FRAME:
            raise UnsupportedError(
                f"encoder frames of {self.frame_ms} ms at {self.sample_rate} Hz (llmrun runs "
                f"{FRAME}-sample frames)"
            )
        windows = self.sliding_windows
        if len(windows) != self.num_hidden_layers or any(
            len(w) != 2 or min(w) < 0 or w[0] < 1 for w in windows
        ):
            raise ModelFormatError(
                f"encoder sliding_windows {windows!r} for {self.num_hidden_layers} layers"
            )
        activation(self.hidden_act)  # refuses an unknown one


@dataclass
class ModelArgs:
    """A MoonshineStreamingConfig: its decoder's fields as Moonshine's ModelArgs, and its
    encoder_config."""

    vocab_size: int = 32768
    hidden_size: int = 320
    intermediate_size: int = 1280
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    head_dim: int | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    encoder_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        heads = self.num_key_value_heads or self.num_attention_heads
        # transformers shapes the decoder's queries by its key/value heads: one count runs.
        if heads != self.num_attention_heads:
            raise UnsupportedError(
                f"decoder num_key_value_heads {heads} and num_attention_heads "
                f"{self.num_attention_heads}: llmrun runs them equal"
            )
        if self.head_dim not in (None, self.hidden_size // self.num_attention_heads):
            raise UnsupportedError(
                f"decoder head_dim {self.head_dim} (llmrun runs hidden_size / heads)"
            )
        self.decoder = moonshine.ModelArgs(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            decoder_num_hidden_layers=self.num_hidden_layers,
            # Moonshine's ModelArgs checks one head count for both; this encoder is not its.
            encoder_num_attention_heads=self.num_attention_heads,
            decoder_num_attention_heads=self.num_attention_heads,
            decoder_hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            # MoonshineStreamingConfig's default RoPE.
            rope_parameters={"partial_rotary_factor": 0.8, **self.rope_parameters},
        )
        encoder = {**ENCODER_DEFAULTS, **self.encoder_config}
        self.encoder = EncoderArgs(**{n: encoder[n] for n in ENCODER_DEFAULTS})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = [n for n in cls.__dataclass_fields__ if n != "rope_parameters"]
        values = {n: config[n] for n in names if config.get(n) is not None}
        return cls(**values, rope_parameters=rope_parameters(config))


class LayerNorm(nn.Module):
    """A LayerNorm without bias whose scale is 1 + gamma."""

    def __init__(self, width: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:]) * (self.gamma + 1.0)


class Compression(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_k = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.asinh(torch.exp(self.log_k) * x)


class CausalConv(nn.Conv1d):
    def __init__(self, width: int, out: int):
        super().__init__(width, out, CONV_KERNEL, stride=CONV_STRIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, width, t] -> [b, out, (t - 1) // 2 + 1], each output seeing only inputs at
        or before it (left-padded with zeros)."""
        return super().forward(F.pad(x, (CONV_KERNEL - 1, 0)))


class Embedder(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        width = args.hidden_size
        self.comp = Compression()
        self.conv1 = CausalConv(width, 2 * width)
        self.conv2 = CausalConv(2 * width, width)
        self.linear = nn.Linear(FRAME, width, bias=False)

    def forward(self, samples: torch.Tensor, frames: int | None) -> torch.Tensor:
        """samples [b, n * FRAME] -> [b, positions, width]; `frames`: how many frames are
        the clip's (the rest, padding, zeroed), None: all."""
        x = samples.unflatten(-1, (-1, FRAME))
        x = x - x.mean(-1, keepdim=True)
        x = x / (x.pow(2).mean(-1, keepdim=True) + CMVN_EPS).sqrt()
        x = F.silu(self.linear(self.comp(x)))
        if frames is not None:
            x[:, frames:] = 0
        x = self.conv2(F.silu(self.conv1(x.transpose(1, 2))))
        return x.transpose(1, 2)


class EncoderAttention(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        width, bias, head_dim = args.hidden_size, args.attention_bias, args.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            head_dim,
        )
        self.q_proj = nn.Linear(width, self.heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * head_dim, width, bias=bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:  # [b, t, h * d] -> [b, h, t, d]
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class EncoderMLP(nn.Module):
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
        self.self_attn = EncoderAttention(args)
        self.mlp = EncoderMLP(args)
        self.input_layernorm = LayerNorm(args.hidden_size)
        self.post_attention_layernorm = LayerNorm(args.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def window(positions: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """Which keys each query sees [positions, positions]: the `left` up to and including
    itself, the `right` - 1 after it."""
    rows = torch.arange(positions, device=device)
    distance = rows[:, None] - rows[None, :]  # query - key
    return ((distance >= 0) & (distance < left)) | ((distance < 0) & (-distance < right))


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.embedder = Embedder(args)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.final_norm = LayerNorm(args.hidden_size)

    def forward(self, samples: torch.Tensor, frames: int | None) -> torch.Tensor:
        """samples [b, n * FRAME] -> [b, positions, width]; `frames`: the clip's (the
        feature extractor's attention mask: the windows apply), None: no mask."""
        x = self.embedder(samples, frames)
        for layer, (left, right) in zip(self.layers, self.args.sliding_windows, strict=True):
            mask = None if frames is None else window(x.shape[1], left, right, x.device)
            x = layer(x, mask)
        return self.final_norm(x)


class StreamingDecoder(Decoder):
    """Moonshine's decoder (its names) and what comes before its cross-attention: learned
    positions added to the encoder's output, and a projection to the decoder's width."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.decoder)
        encoder_width = args.encoder.hidden_size
        self.pos_emb = nn.Embedding(args.max_position_embeddings, encoder_width)
        self.proj = (
            nn.Linear(encoder_width, args.hidden_size, bias=False)
            if encoder_width != args.hidden_size
            else nn.Identity()
        )


class MoonshineStreaming(nn.Module):
    """HF's MoonshineStreamingModel: `encoder` and `decoder`, under its names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.encoder = Encoder(args.encoder)
        self.decoder = StreamingDecoder(args)


def positions(samples: int) -> int:
    """The encoder positions of a clip of `samples` (padded to whole frames)."""
    frames = -(-samples // FRAME)
    for _ in range(2):
        frames = (frames - 1) // CONV_STRIDE + 1
    return frames


class Model(nn.Module):
    """MoonshineStreamingForConditionalGeneration without its generate: `encode` a clip's
    samples, `cross_cache` its encoding once, then `decode` ids step by step."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.moonshine_streaming
    transcribes = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args.decoder  # what llmrun.seq2seq and Moonshine's decoder read
        self.streaming_args = args
        self.model = MoonshineStreaming(args)
        self.proj_out = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def encode(self, samples: torch.Tensor, frames: int | None) -> torch.Tensor:
        """A clip's samples [b, n * FRAME] (zero-padded to whole frames) -> the encoder's
        positions [b, positions, width]; `frames`: how many frames are the clip's (the
        feature extractor's attention mask), None: no mask."""
        count = samples.shape[-1]
        if count < FRAME or count % FRAME:
            raise ValueError(f"{count} samples: not whole {FRAME}-sample frames")
        if positions(count) > self.args.max_position_embeddings:
            raise ValueError(
                f"{count} samples: {positions(count)} encoder positions, over the decoder's "
                f"{self.args.max_position_embeddings}"
            )
        return self.model.encoder(samples, frames)

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding (its
        positions added, projected to the decoder's width)."""
        decoder = self.model.decoder
        places = torch.arange(encoded.shape[1], device=encoded.device)
        memory = decoder.proj(encoded + decoder.pos_emb(places))
        return [layer.encoder_attn.keys_values(memory) for layer in decoder.layers]

    # Moonshine's decoder, under the same names.
    new_cache = moonshine.Model.new_cache
    decode = moonshine.Model.decode
