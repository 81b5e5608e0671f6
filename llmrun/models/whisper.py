"""OpenAI's Whisper (WhisperForConditionalGeneration): speech recognition by an
encoder-decoder. The encoder is llmrun.models.whisper_encoder's tower (log-mel features
[1, mel bins, 3000] -> [1, 1500, d_model]); the decoder is pre-LayerNorm layers of causal
self-attention (keys and values in a cache), cross-attention to the encoder's output (its
keys and values computed once per 30-second window and kept) and a GELU MLP, with learned
positions and the output head tied to the token embedding.

Reference: transformers/models/whisper/modeling_whisper.py (WhisperDecoder,
WhisperDecoderLayer, WhisperAttention, WhisperForConditionalGeneration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation
from llmrun.models.whisper_encoder import EncoderArgs, WhisperEncoder


@dataclass
class ModelArgs:
    """A WhisperConfig's fields, by its names."""

    vocab_size: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    max_target_positions: int = 448
    activation_function: str = "gelu"
    scale_embedding: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.decoder_attention_heads:
            raise ModelFormatError(
                f"d_model {self.d_model} does not split into {self.decoder_attention_heads} heads"
            )
        activation(self.activation_function)  # refuses an unknown one
        if self.max_source_positions != 1500:
            raise ModelFormatError(
                f"max_source_positions {self.max_source_positions}: Whisper's windows are 30 "
                "seconds, 1500 encoder positions"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = [
            "vocab_size",
            "d_model",
            "encoder_layers",
            "encoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_layers",
            "decoder_attention_heads",
            "decoder_ffn_dim",
        ]
        optional = [
            "num_mel_bins",
            "max_source_positions",
            "max_target_positions",
            "activation_function",
            "scale_embedding",
        ]
        missing = [name for name in names if config.get(name) is None]
        if missing:
            raise ModelFormatError(f"the Whisper config.json has no {', '.join(missing)}")
        return cls(
            **{name: config[name] for name in names},
            **{name: config[name] for name in optional if config.get(name) is not None},
        )

    @property
    def encoder(self) -> EncoderArgs:
        return EncoderArgs(
            hidden_size=self.d_model,
            intermediate_size=self.encoder_ffn_dim,
            num_hidden_layers=self.encoder_layers,
            num_attention_heads=self.encoder_attention_heads,
            num_mel_bins=self.num_mel_bins,
            max_source_positions=self.max_source_positions,
            text_hidden_size=self.d_model,
            activation_function=self.activation_function,
        )


class Attention(nn.Module):
    """Whisper's attention: biases on q, v and out, none on k; q scaled before the product.
    A family built on it sets `key_bias` and `queries_scaled_first` to its own."""

    key_bias = False
    queries_scaled_first = True  # WhisperAttention's order; else scaled inside the product

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width, bias=self.key_bias)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[b, t, width] -> [b, heads, t, head_dim]."""
        b, t, width = x.shape
        return x.view(b, t, self.heads, width // self.heads).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k_proj(x)), self.split(self.v_proj(x))

    def forward(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None
    ) -> torch.Tensor:
        """x [b, t, width] attending to k, v [b, heads, s, head_dim]; `causal_from`: the
        position of x's first row among k's (self-attention), None: all of k (cross)."""
        b, t, width = x.shape
        q, scale = self.q_proj(x), None
        if self.queries_scaled_first:
            q, scale = q * (width // self.heads) ** -0.5, 1.0
        mask = None
        if causal_from is not None and t > 1:
            rows = torch.arange(t, device=x.device)[:, None] + causal_from
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(self.split(q), k, v, attn_mask=mask, scale=scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, width))

    def weights(self, x: torch.Tensor, k: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """The attention weights [b, len(heads), t, s] of x [b, t, width] over all of k
        [b, heads, s, head_dim] (cross-attention: no mask) in the heads `heads`."""
        width = x.shape[-1]
        q = self.split(self.q_proj(x))[:, heads] * (width // self.heads) ** -0.5
        return torch.softmax(q @ k[:, heads].transpose(-1, -2), dim=-1)


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention  # a family built on this layer swaps in its own

    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.d_model
        self.self_attn = self.attention_class(width, args.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.encoder_attn = self.attention_class(width, args.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, args.decoder_ffn_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_dim, width)
        self.final_layer_norm = nn.LayerNorm(width)
        self.act = activation(args.activation_function)

    def forward(
        self,
        x: torch.Tensor,
        cache: SelfCache,
        index: int,
        start: int,
        cross: CrossCache,
        weights: list[torch.Tensor] | None = None,
        heads: Sequence[int] = (),
    ) -> torch.Tensor:
        """The layer's output; `weights`: where the cross-attention weights of `heads` go
        (llmrun.whisper's word timestamps)."""
        h = self.self_attn_layer_norm(x)
        k, v = cache.update(index, *self.self_attn.keys_values(h), start)
        x = x + self.self_attn(h, k, v, causal_from=start)
        h = self.encoder_attn_layer_norm(x)
        if weights is not None and heads:
            weights.append(self.encoder_attn.weights(h, cross[index][0], list(heads)))
        x = x + self.encoder_attn(h, *cross[index], causal_from=None)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.d_model)
        self.embed_positions = nn.Embedding(args.max_target_positions, args.d_model)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.decoder_layers))
        self.layer_norm = nn.LayerNorm(args.d_model)
        self.embed_scale = args.d_model**0.5 if args.scale_embedding else 1.0


class Whisper(nn.Module):
    """HF's WhisperModel: `encoder` and `decoder`, under its names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.encoder = WhisperEncoder(args.encoder)
        self.decoder = Decoder(args)


# Each decoder layer's cross-attention keys and values, [b, heads, 1500, head_dim] each.
CrossCache = list[tuple[torch.Tensor, torch.Tensor]]


class SelfCache:
    """The decoder's self-attention keys and values, [b, heads, positions, head_dim] per
    layer, preallocated."""

    def __init__(
        self, args: ModelArgs, batch: int, positions: int, device: torch.device, dtype: torch.dtype
    ):
        heads = args.decoder_attention_heads
        shape = (batch, heads, positions, args.d_model // heads)
        self.k = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.decoder_layers)
        ]
        self.v = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.decoder_layers)
        ]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, heads, t, head_dim] at positions start.. and return all so far."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def reorder_rows(self, rows: torch.Tensor) -> None:
        """Row i takes what row rows[i] held (beam search: each beam goes on from one of
        the last step's)."""
        for cache in (*self.k, *self.v):
            cache.copy_(cache.index_select(0, rows))


class Model(nn.Module):
    """WhisperForConditionalGeneration without its generate: `encode` a window's log-mel
    features, `cross_cache` its encoding once, then `decode` ids step by step."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.whisper decodes it
    transcribes = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Whisper(args)
        self.proj_out = nn.Linear(args.d_model, args.vocab_size, bias=False)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """[b, mel bins, 2 * max_source_positions] -> [b, max_source_positions, d_model]."""
        expected = (self.args.num_mel_bins, 2 * self.args.max_source_positions)
        if tuple(features.shape[1:]) != expected:
            raise ValueError(f"Whisper features of shape {list(features.shape)}")
        return self.model.encoder(features)

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding."""
        return [layer.encoder_attn.keys_values(encoded) for layer in self.model.decoder.layers]

    def new_cache(self, batch: int = 1, positions: int | None = None) -> SelfCache:
        """A cache of `positions` (all the decoder's by default) for `batch` sequences."""
        norm = self.model.decoder.layer_norm.weight
        size = positions or self.args.max_target_positions
        return SelfCache(self.args, batch, size, norm.device, norm.dtype)

    def decode(
        self,
        ids: torch.Tensor,
        cache: SelfCache,
        start: int,
        cross: CrossCache,
        alignment: list[torch.Tensor] | None = None,
        alignment_heads: tuple[tuple[int, int], ...] = (),
    ) -> torch.Tensor:
        """Logits [b, t, vocab] of ids [b, t] at positions start.. (the cache holds the ids
        before them); `alignment`: where the cross-attention weights [b, t, 1500] of each
        (layer, head) of `alignment_heads` go, in their order (computed only then)."""
        decoder = self.model.decoder
        end = start + ids.shape[1]
        if end > self.args.max_target_positions:
            raise ValueError(
                f"decoder positions up to {end}, over {self.args.max_target_positions}"
            )
        x = decoder.embed_tokens(ids) * decoder.embed_scale
        x = x + decoder.embed_positions(torch.arange(start, end, device=ids.device))
        weights: dict[tuple[int, int], torch.Tensor] = {}
        for index, layer in enumerate(decoder.layers):
            heads = [h for layer_index, h in alignment_heads if layer_index == index]
            found: list[torch.Tensor] | None = [] if alignment is not None and heads else None
            x = layer(x, cache, index, start, cross, found, heads)
            if found:
                weights.update(
                    ((index, h), w) for h, w in zip(heads, found[0].unbind(1), strict=True)
                )
        if alignment is not None:
            alignment += [weights[pair] for pair in alignment_heads]
        return self.proj_out(decoder.layer_norm(x))
