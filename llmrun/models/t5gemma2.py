"""T5Gemma 2 text-to-text models (T5Gemma2ForConditionalGeneration: google/t5gemma-2-270m-270m,
-1b-1b, -4b-4b): an encoder and a decoder of Gemma 3 layers (llmrun.models.gemma3's
attention: an RMSNorm on each query and key head, RoPE of its own base for global and for
sliding layers, no score soft-capping), one embedding shared by encoder, decoder and head;
images (SigLIP's, Gemma 3's encoder: llmrun.loading.t5gemma2_vision) in the encoder's input.
The encoder attends both ways, its sliding layers to a window of sliding_window positions
around each query, (sliding_window + 1) // 2 back (itself included) and sliding_window // 2
ahead, as transformers' bidirectional sliding mask has it. Each decoder layer's attention
is merged: its queries attend in one softmax to the decoder's own keys (causal, or the
sliding window) and to the encoding's, which its own k_proj (with k_norm, without RoPE) and
v_proj make. The end-of-image token (eoi_token_index) embeds as the file's eoi_embedding,
unscaled.

`encode` runs the prompt once; `decoding(encoded)` is the decoder bound to that encoding,
called as any llmrun language model is (ids, positions, KV cache), so llmrun.generate's one
loop drives it (llmrun.text_to_text).

Reference: transformers/models/t5gemma2/modeling_t5gemma2.py (T5Gemma2TextScaledWordEmbedding,
T5Gemma2MergedAttention, sliding_window_mask_function, T5Gemma2TextEncoder, T5Gemma2Decoder,
T5Gemma2ForConditionalGeneration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import gemma3, t5gemma
from llmrun.models.base import (
    Frame,
    GatedMLP,
    GemmaRMSNorm,
    RotaryEmbedding,
    attention,
    layer_frames,
    new_cache,
)
from llmrun.models.cache import KVCache
from llmrun.models.t5gemma import CrossCache, Head, stack_args, start_token

StackArgs = gemma3.ModelArgs  # a T5Gemma2TextConfig's fields are Gemma 3's
EOI_TOKEN_INDEX = 256_000  # T5Gemma2EncoderConfig's default


@dataclass
class ModelArgs:
    """A T5Gemma2Config's text: its encoder's text_config and its decoder's, the token the
    decoder starts from (decoder_start_token_id, else bos_token_id, as generate picks it)
    and the end-of-image token."""

    encoder: StackArgs
    decoder: StackArgs
    decoder_start_token_id: int
    eoi_token_index: int = EOI_TOKEN_INDEX

    def __post_init__(self) -> None:
        if self.encoder.hidden_size != self.decoder.hidden_size:
            raise ModelFormatError(
                f"a T5Gemma 2 encoder {self.encoder.hidden_size} wide and a decoder "
                f"{self.decoder.hidden_size} wide: T5Gemma 2's share their embedding"
            )
        if self.encoder.vocab_size != self.decoder.vocab_size:
            raise ModelFormatError("a T5Gemma 2 encoder and decoder of different vocabularies")
        # What llmrun's KV cache (the decoder's self-attention) and the sampler read.
        self.num_hidden_layers = self.decoder.num_hidden_layers
        self.num_key_value_heads = self.decoder.num_key_value_heads
        self.head_dim = self.decoder.head_dim
        self.vocab_size = self.decoder.vocab_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        encoder = config.get("encoder")
        text = encoder.get("text_config") if isinstance(encoder, dict) else None
        encoder_stack = stack_args(text, "T5Gemma 2", "encoder's text_config", StackArgs)
        decoder = stack_args(config.get("decoder"), "T5Gemma 2", "decoder", StackArgs)
        eoi = config.get("eoi_token_index", encoder.get("eoi_token_index"))
        return cls(
            encoder_stack,
            decoder,
            start_token(config, "T5Gemma 2", decoder.vocab_size),
            EOI_TOKEN_INDEX if eoi is None else eoi,
        )


class MergedAttention(gemma3.Attention):
    """Gemma 3's attention whose queries also see the encoding's keys and values (made by
    the same k_proj, k_norm and v_proj, without RoPE), in one softmax."""

    def keys_values(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoding's keys and values [1, Hkv, S, D] each."""
        b, s, _ = encoded.shape
        k = self.k_norm(self.k_proj(encoded).view(b, s, self.n_kv_heads, self.head_dim))
        v = self.v_proj(encoded).view(b, s, self.n_kv_heads, self.head_dim)
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def merged(
        self,
        x: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None,
        cross: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q.transpose(1, 2)), frame.rotate(k.transpose(1, 2))
        if cache is not None:
            k, v = cache.update(self.layer, k, v, frame.positions, frame.start, frame.length)
        cross_k, cross_v = cross
        mask = frame.mask
        if mask is not None:  # [B, 1, T, L] -> [B, 1, T, L + S]: every encoded key seen
            seen = mask.new_ones(*mask.shape[:-1], cross_k.shape[2])
            mask = torch.cat((mask, seen), dim=-1)
        k, v = (
            torch.cat((k, cross_k.to(k.dtype)), dim=2),
            torch.cat((v, cross_v.to(v.dtype)), dim=2),
        )
        return self.o_proj(attention(q, k, v, mask, self.scale))


class Layer(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x))); a
    decoder layer's attention is merged."""

    def __init__(self, args: StackArgs, layer: int, decoder: bool) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = (MergedAttention if decoder else gemma3.Attention)(args, layer)
        self.pre_self_attn_layernorm = GemmaRMSNorm(dim, eps)
        self.post_self_attn_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = GatedMLP(args)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None = None,
        cross: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        h = self.pre_self_attn_layernorm(x)
        if cross is None:
            h = self.self_attn(h, frames, cache)
        else:
            h = self.self_attn.merged(h, frames, cache, cross)
        x = x + self.post_self_attn_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Stack(nn.Module):
    """T5Gemma2TextEncoder's or T5Gemma2Decoder's modules: embedding, layers, norm, and
    the RoPE of global and of sliding layers."""

    def __init__(self, args: ModelArgs, stack: StackArgs, decoder: bool) -> None:
        super().__init__()
        self.args, self.eoi = stack, args.eoi_token_index
        self.embed_tokens = nn.Embedding(args.vocab_size, stack.hidden_size)
        # The file's embed_tokens.eoi_embedding (llmrun.loading.t5gemma renames it): a
        # module of its own would not survive the loader's swap of a half-precision
        # embedding for a QuantEmbedding.
        self.eoi_embedding = nn.Parameter(torch.zeros(stack.hidden_size))
        self.layers = nn.ModuleList(
            Layer(stack, i, decoder) for i in range(stack.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(stack.hidden_size, stack.rms_norm_eps)
        positions = stack.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(stack.rope_parameters, stack.head_dim, positions)
        self.rotary_emb_local = RotaryEmbedding(
            stack.rope_local_parameters, stack.head_dim, positions
        )

    def causal_frames(
        self, positions: torch.Tensor, cache: KVCache | None, dtype: torch.dtype
    ) -> dict[str, Frame]:
        """A decoder's frames, by layer type, of tokens at `positions` after those `cache`
        holds: global and sliding layers each with their RoPE."""
        return layer_frames(
            positions,
            cache,
            dtype,
            self.args.sliding_window,
            self.rotary_emb,
            self.rotary_emb_local,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """T5Gemma2TextScaledWordEmbedding: rows scaled by sqrt(hidden) (the scale rounded
        to the compute dtype), the end-of-image token's replaced by eoi_embedding."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.args.hidden_size**0.5).to(x.dtype)
        eoi = (input_ids == self.eoi)[..., None]
        return torch.where(eoi, self.eoi_embedding.to(x.dtype), x)


class Body(nn.Module):
    """T5Gemma2Model's text: `encoder` and `decoder`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.encoder = Stack(args, args.encoder, decoder=False)
        self.decoder = Stack(args, args.decoder, decoder=True)


def encoder_window(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys each query at `positions` [S] sees in a sliding encoder layer [1, 1, S, S]:
    (window + 1) // 2 back, itself included, and window // 2 ahead."""
    behind = positions[:, None] - positions[None, :]  # query - key
    ahead = -behind
    seen = ((behind >= 0) & (behind < (window + 1) // 2)) | ((ahead > 0) & (ahead <= window // 2))
    return seen[None, None]


class Model(nn.Module):
    """T5Gemma2ForConditionalGeneration's text modules under its names, without its
    generate."""

    text_to_text = True  # generated through llmrun.text_to_text, not the batching scheduler

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = Head(args)

    def encode(self, input_ids: torch.Tensor, images: Any = None) -> torch.Tensor:
        """The encoder's output [1, S, hidden] of a prompt's ids [1, S]; `images`
        (llmrun.multimodal.PromptImages): each image's soft tokens in place of its
        placeholders, as transformers scatters the image features."""
        encoder = self.model.encoder
        x = encoder.embed(input_ids)
        if images is not None:
            for start, embeds in zip(images.starts, images.embeds, strict=True):
                x[0, start : start + len(embeds)] = embeds.to(x.dtype)
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)[None]

        def frame(rotary: RotaryEmbedding, mask: torch.Tensor | None) -> Frame:
            cos, sin = rotary(positions)
            # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
            return Frame(
                positions, 0, length, mask, cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
            )

        near = encoder_window(positions[0], encoder.args.sliding_window)
        frames = {
            "full_attention": frame(encoder.rotary_emb, None),
            "sliding_attention": frame(encoder.rotary_emb_local, near),
        }
        for layer in encoder.layers:
            x = layer(x, frames)
        return encoder.norm(x)

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's keys and values of an encoding."""
        return [layer.self_attn.keys_values(encoded) for layer in self.model.decoder.layers]

    def decoding(self, encoded: torch.Tensor) -> t5gemma.Decoding:
        """The decoder, attending to `encoded` (a prompt's encode())."""
        return t5gemma.Decoding(self, self.cross_cache(encoded))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """The decoder's self-attention cache (its sliding layers' keys kept whole)."""
        return new_cache(self.args, batch, max_seq_len, dtype, device)
