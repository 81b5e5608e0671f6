"""TrOCR's text decoder (TrOCRForCausalLM, the decoder of microsoft/trocr-* as a
VisionEncoderDecoderModel holds it): BART's decoder layers (biased q, k, v, out projections,
post-norm residuals, a feed-forward of fc1, the activation, fc2) whose cross-attention reads
the image encoder's tokens through keys and values of its own width
(cross_attention_hidden_size); the token embedding scaled by sqrt(d_model) where
scale_embedding says, plus learned positions read two rows on (or, without
use_learned_position_embeddings, fairseq's sinusoids two rows on, as M2M100's, zero for the
padding token), normalized
where layernorm_embedding says; an output projection without bias (tied to the embedding
where tie_word_embeddings says: the loader gives it the embedding).

The image encoder (ViT or DeiT: llmrun.models.vit) runs as a vision family's encoder
(llmrun.trocr_images); `encode` takes its tokens as the source, and `decoding(encoded)` is the
decoder bound to them, which llmrun.text_to_text drives as it drives BART's.

Reference: transformers/models/trocr/modeling_trocr.py (TrOCRDecoder, TrOCRDecoderLayer,
TrOCRLearnedPositionalEmbedding, TrOCRSinusoidalPositionalEmbedding),
models/vision_encoder_decoder/modeling_vision_encoder_decoder.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ContextOverflowError, ModelFormatError, UsageError
from llmrun.models.bart import (
    POSITION_OFFSET,
    Attention,
    CrossCache,
    TextToText,
    fairseq_positions,
    run_decoder,
)
from llmrun.models.base import activation
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    """TrOCRConfig's fields, by its names (its defaults: trocr-base's)."""

    vocab_size: int = 50265
    d_model: int = 1024
    decoder_layers: int = 12
    decoder_attention_heads: int = 16
    decoder_ffn_dim: int = 4096
    activation_function: str = "gelu"
    max_position_embeddings: int = 512
    decoder_start_token_id: int = 2
    pad_token_id: int | None = 1
    scale_embedding: bool = False
    use_learned_position_embeddings: bool = True
    layernorm_embedding: bool = True
    cross_attention_hidden_size: int | None = None

    def __post_init__(self) -> None:
        if self.d_model % self.decoder_attention_heads:
            raise ModelFormatError(
                f"d_model {self.d_model} is not a multiple of decoder_attention_heads"
            )
        activation(self.activation_function)
        # What llmrun's KV cache (the decoder's self-attention) reads.
        self.num_hidden_layers = self.decoder_layers
        self.num_key_value_heads = self.decoder_attention_heads
        self.head_dim = self.d_model // self.decoder_attention_heads
        self.source_width = self.cross_attention_hidden_size or self.d_model

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = [n for n in cls.__dataclass_fields__ if config.get(n) is not None]
        return cls(**{n: config[n] for n in names})


class Layer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, heads = args.d_model, args.decoder_attention_heads
        self.self_attn = Attention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = Attention(dim, heads, args.source_width)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, args.decoder_ffn_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.act = activation(args.activation_function)

    @staticmethod
    def residual(
        x: torch.Tensor, norm: nn.Module, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return norm(x + sublayer(x))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.d_model)
        if args.use_learned_position_embeddings:
            rows = args.max_position_embeddings + POSITION_OFFSET
            self.embed_positions = nn.Embedding(rows, args.d_model)
        if args.layernorm_embedding:
            self.layernorm_embedding = nn.LayerNorm(args.d_model)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.decoder_layers))


class Inner(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.decoder = Decoder(args)


class Model(TextToText):
    """TrOCRForCausalLM's modules under its names (model.decoder.*, output_projection)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Inner(args)
        self.output_projection = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.embed_scale = math.sqrt(args.d_model) if args.scale_embedding else 1.0

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decoder's input [B, T, d_model]: scaled token embeddings plus positions."""
        last = int(positions.max())
        if last >= self.args.max_position_embeddings:
            raise ContextOverflowError(
                f"position {last} is past the decoder's {self.args.max_position_embeddings}"
            )
        decoder = self.model.decoder
        x = decoder.embed_tokens(input_ids) * self.embed_scale
        if self.args.use_learned_position_embeddings:
            x = x + decoder.embed_positions(positions + POSITION_OFFSET)
        else:  # the padding token's position vector is zero, as fairseq's table row is
            table = fairseq_positions(positions + POSITION_OFFSET, self.args.d_model)
            if self.args.pad_token_id is not None:
                table = table.masked_fill((input_ids == self.args.pad_token_id)[..., None], 0.0)
            x = x + table.to(x.dtype)
        return decoder.layernorm_embedding(x) if self.args.layernorm_embedding else x

    def encode(self, input_ids: torch.Tensor, images: Any = None) -> torch.Tensor:
        """The source [1, tokens, width]: the one image's encoder tokens (`input_ids` holds
        its placeholder, llmrun.trocr_images)."""
        if images is None or len(images.embeds) != 1:
            raise UsageError("TrOCR reads the text of one image: give it one (--image)")
        return images.embeds[0][None].to(self.output_projection.weight)  # its device, dtype

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None,
        cross: CrossCache,
        last_only: bool,
    ) -> torch.Tensor:
        """The decoder's float32 logits [B, T, vocab] ([B, 1, vocab] with last_only) of ids
        [B, T] at positions [B, T], attending to `cross` (cross_cache's)."""
        x = self.embed(input_ids, positions)
        x = run_decoder(self.model.decoder.layers, x, positions, cache, cross)
        if last_only:
            x = x[:, -1:]
        return self.output_projection(x).float()
