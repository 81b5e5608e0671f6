"""Cohere Transcribe (CohereAsrForConditionalGeneration): speech recognition by an
encoder-decoder. The encoder is Parakeet's FastConformer (llmrun.models.parakeet_encoder's
Conformer: normalized log-mel frames -> one position per 8 frames); its output is projected
to the decoder's width. The decoder embeds tokens plus learned positions under a LayerNorm,
then pre-LayerNorm layers of causal self-attention (grouped keys and values, in a cache),
cross-attention to the encoder's positions (their keys and values computed once per clip)
and a ReLU MLP; a final LayerNorm and an output head with a bias.

Reference: transformers/models/cohere_asr/modeling_cohere_asr.py (CohereAsrDecoder,
CohereAsrDecoderLayer, CohereAsrSelfAttention, CohereAsrCrossAttention, CohereAsrModel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation
from llmrun.models.moonshine import CrossCache, SelfCache  # the same preallocated caches
from llmrun.models.parakeet_encoder import Conformer, EncoderArgs

# CohereAsrConfig's encoder_config defaults (its sub_configs_defaults), under
# ParakeetEncoderConfig's names.
ENCODER_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1280,
    num_hidden_layers=48,
    num_attention_heads=8,
    intermediate_size=5120,
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


@dataclass
class ModelArgs:
    """A CohereAsrConfig's fields, by its names."""

    vocab_size: int = 16384
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    intermediate_size: int = 4096
    hidden_act: str = "relu"
    max_position_embeddings: int = 1024
    attention_bias: bool = True
    head_dim: int | None = None
    encoder_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"{self.num_attention_heads} attention heads do not group into "
                f"{self.num_key_value_heads} key/value heads"
            )
        activation(self.hidden_act)  # refuses an unknown one
        self.encoder = EncoderArgs.conformer(self.encoder_config, ENCODER_DEFAULTS)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "hidden_act",
            "max_position_embeddings",
            "attention_bias",
            "head_dim",
            "encoder_config",
        ]
        return cls(**{n: config[n] for n in names if config.get(n) is not None})


class Attention(nn.Module):
    """Self- or cross-attention with grouped keys and values, scaled by head_dim**-0.5."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        width, bias = args.hidden_size, args.attention_bias
        self.heads, self.kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=bias)

    def split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[b, t, heads * head_dim] -> [b, heads, t, head_dim]."""
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k_proj(x), self.kv_heads), self.split(self.v_proj(x), self.kv_heads)

    def forward(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None
    ) -> torch.Tensor:
        """x [b, t, width] attending to k, v [b, kv_heads, s, head_dim]; `causal_from`: the
        position of x's first row among k's (self-attention), None: all of k (cross)."""
        b, t, _ = x.shape
        q = self.split(self.q_proj(x), self.heads)
        mask = None
        if causal_from is not None and t > 1:
            rows = torch.arange(t, device=x.device)[:, None] + causal_from
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.hidden_size
        self.self_attn = Attention(args)
        self.encoder_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.LayerNorm(width)
        self.post_attention_layernorm = nn.LayerNorm(width)
        self.final_layernorm = nn.LayerNorm(width)

    def forward(
        self, x: torch.Tensor, cache: SelfCache, index: int, start: int, cross: CrossCache
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        k, v = cache.update(index, *self.self_attn.keys_values(h), start)
        x = x + self.self_attn(h, k, v, causal_from=start)
        x = x + self.encoder_attn(self.post_attention_layernorm(x), *cross[index], None)
        return x + self.mlp(self.final_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, width)
        self.pos_emb = nn.Embedding(args.max_position_embeddings, width)
        self.embedding_layernorm = nn.LayerNorm(width)
        self.proj = nn.Linear(args.encoder.hidden_size, width)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = nn.LayerNorm(width)


class CohereAsr(nn.Module):
    """HF's CohereAsrModel: `encoder` and `decoder`, under its names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.encoder = Conformer(args.encoder)
        self.decoder = Decoder(args)


class Model(nn.Module):
    """CohereAsrForConditionalGeneration without its generate: `encode` a clip's features,
    `cross_cache` its encoding once, then `decode` ids step by step."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.cohere_asr decodes it
    transcribes = True
    family = "Cohere Transcribe"

    def __init__(self, args: ModelArgs, model: nn.Module | None = None):
        """`model`: the encoder and decoder (a family built on this one's), else CohereAsr's."""
        super().__init__()
        self.args = args
        self.model = CohereAsr(args) if model is None else model
        self.proj_out = nn.Linear(args.hidden_size, args.vocab_size)

    def encode(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        """A clip's features [frames, mel] (its first `valid` frames in the feature
        extractor's mask) -> the encoder's positions in that mask [1, positions, hidden],
        which the decoder attends to."""
        encoder = self.args.encoder
        if features.shape[1] != encoder.num_mel_bins:
            raise ValueError(f"{self.family} features of shape {list(features.shape)}")
        return self.model.encoder(features, valid)[None, : encoder.tokens(valid)]

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding, projected
        to the decoder's width."""
        projected = self.model.decoder.proj(encoded)
        return [layer.encoder_attn.keys_values(projected) for layer in self.model.decoder.layers]

    def new_cache(self, batch: int = 1) -> SelfCache:
        """A cache of all the decoder's positions for `batch` sequences."""
        args, norm = self.args, self.model.decoder.norm.weight
        shape = (batch, args.num_key_value_heads, args.max_position_embeddings, args.head_dim)
        return SelfCache(args.num_hidden_layers, shape, norm.device, norm.dtype)

    def decode(
        self, ids: torch.Tensor, cache: SelfCache, start: int, cross: CrossCache
    ) -> torch.Tensor:
        """Logits [b, t, vocab] of ids [b, t] at positions start.. (the cache holds the ids
        before them)."""
        decoder = self.model.decoder
        end = start + ids.shape[1]
        if end > self.args.max_position_embeddings:
            raise ValueError(
                f"decoder positions up to {end}, over {self.args.max_position_embeddings}"
            )
        x = self.embed(ids, start, end)
        for index, layer in enumerate(decoder.layers):
            x = layer(x, cache, index, start, cross)
        return self.proj_out(decoder.norm(x))

    def embed(self, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The decoder's input [b, t, width] of ids [b, t] at positions start..end: token
        embeddings plus learned positions, under a LayerNorm."""
        decoder = self.model.decoder
        positions = decoder.pos_emb(torch.arange(start, end, device=ids.device))
        return decoder.embedding_layernorm(decoder.embed_tokens(ids) + positions)
