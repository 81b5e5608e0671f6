"""NVIDIA Canary (CanaryForConditionalGeneration): speech recognition and translation by an
encoder-decoder. Cohere Transcribe's (llmrun.models.cohere_asr) but for two things: the
encoder's output goes to the decoder's cross-attention unprojected (both are one width),
and the decoder's positions are NeMo's fixed sinusoids (sines then cosines over timescales
up to 10000^((width-2)/width), scaled by 1/sqrt(width)), not learned. Its layers are
Cohere Transcribe's (pre-LayerNorm causal self-attention with grouped keys and values,
cross-attention, a ReLU MLP), and the output head, with a bias, is tied to the token
embedding unless the config says not.

Reference: transformers/models/canary/modeling_canary.py (CanaryPositionalEmbedding,
CanaryDecoder, CanaryModel, CanaryForConditionalGeneration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import cohere_asr
from llmrun.models.cohere_asr import CrossCache, DecoderLayer
from llmrun.models.parakeet_encoder import Conformer

# CanaryConfig's encoder_config defaults: ParakeetEncoderConfig's, with its init_kwargs.
ENCODER_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=32,
    num_attention_heads=8,
    intermediate_size=4096,
    hidden_act="silu",
    attention_bias=True,
    convolution_bias=True,
    conv_kernel_size=9,
    subsampling_factor=8,
    subsampling_conv_channels=256,
    num_mel_bins=128,
    subsampling_conv_kernel_size=3,
    subsampling_conv_stride=2,
    scale_input=False,
)
# CanaryDecoderConfig's fields read, and their defaults.
DECODER_DEFAULTS: dict[str, Any] = dict(
    vocab_size=16384,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=4096,
    hidden_act="relu",
    max_position_embeddings=1024,
    attention_bias=True,
    head_dim=128,
)


@dataclass
class ModelArgs:
    """A CanaryConfig: its decoder's fields (Cohere Transcribe's ModelArgs, which also
    builds the encoder's) and its vocabulary."""

    decoder_config: dict[str, Any] = field(default_factory=dict)
    encoder_config: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 16384

    def __post_init__(self) -> None:
        decoder = {**DECODER_DEFAULTS, **self.decoder_config}
        self.decoder = cohere_asr.ModelArgs(
            **{n: decoder[n] for n in DECODER_DEFAULTS},
            encoder_config={**ENCODER_DEFAULTS, **self.encoder_config},
        )
        self.encoder = self.decoder.encoder
        if self.decoder.vocab_size != self.vocab_size:
            raise ModelFormatError(
                f"the decoder's vocab_size {self.decoder.vocab_size}, the config's "
                f"{self.vocab_size}"
            )
        if self.encoder.hidden_size != self.decoder.hidden_size:
            raise ModelFormatError(
                f"the encoder's hidden_size {self.encoder.hidden_size}, the decoder's "
                f"{self.decoder.hidden_size}: Canary's decoder attends to the encoder unprojected"
            )
        if self.decoder.hidden_size % 2:
            raise ModelFormatError(f"decoder hidden_size {self.decoder.hidden_size} is odd")
        self.max_position_embeddings = self.decoder.max_position_embeddings

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = ["decoder_config", "encoder_config", "vocab_size"]
        return cls(**{n: config[n] for n in names if config.get(n) is not None})


def sinusoids(start: int, end: int, width: int, device: torch.device) -> torch.Tensor:
    """The position embeddings [end - start, width] of positions start.. (float32), as
    CanaryPositionalEmbedding's table holds them."""
    timescale = 10000 ** ((width - 2) / width)
    increment = math.log(timescale) / (width // 2 - 1)
    inverse = torch.exp(-increment * torch.arange(width // 2, device=device).float())
    scaled = torch.arange(start, end, device=device)[:, None] * inverse[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1) / math.sqrt(width)


class Decoder(nn.Module):
    def __init__(self, args: cohere_asr.ModelArgs):
        super().__init__()
        width = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, width)
        self.embedding_layernorm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = nn.LayerNorm(width)


class Canary(nn.Module):
    """HF's CanaryModel: `encoder` and `decoder`, under its names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.encoder = Conformer(args.encoder)
        self.decoder = Decoder(args.decoder)


class Model(cohere_asr.Model):
    """CanaryForConditionalGeneration without its generate: Cohere Transcribe's Model (`encode`
    a clip's features, `cross_cache` its encoding once, then `decode` ids step by step) with
    Canary's unprojected cross-attention and sinusoid positions."""

    family = "Canary"

    def __init__(self, args: ModelArgs):
        # args.decoder: what llmrun.seq2seq reads (vocab_size, positions)
        super().__init__(args.decoder, Canary(args))
        self.encoder_args = args.encoder

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding."""
        return [layer.encoder_attn.keys_values(encoded) for layer in self.model.decoder.layers]

    def embed(self, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The decoder's input [b, t, width] of ids [b, t] at positions start..end: token
        embeddings plus NeMo's sinusoids, under a LayerNorm."""
        decoder = self.model.decoder
        x = decoder.embed_tokens(ids)
        positions = sinusoids(start, end, self.args.hidden_size, ids.device).to(x.dtype)
        return decoder.embedding_layernorm(x + positions)
