"""T5Gemma text-to-text models (T5GemmaForConditionalGeneration: google/t5gemma-2b-2b-*,
t5gemma-9b-9b-*, t5gemma-9b-2b-*, their -it chat models): an encoder and a decoder of Gemma 2
layers (llmrun.models.gemma2's attention: RoPE, grouped keys and values, scores scaled by
query_pre_attn_scalar**-0.5 and soft-capped, sliding-window layers between global ones;
norms before and after each part). The encoder attends both ways, its sliding layers to the
keys within sliding_window positions either side (the window's edge included, as
transformers' bidirectional sliding mask); each decoder layer adds a cross-attention to the
encoding (no RoPE, soft-capped scores) between its self-attention and its feed-forward.
The head is the decoder's embedding unless the file unties it; its logits are soft-capped.

`encode` runs the prompt once; `decoding(encoded)` is the decoder bound to that encoding,
called as any llmrun language model is (ids, positions, KV cache), so llmrun.generate's one
loop drives it (llmrun.text_to_text).

Reference: transformers/models/t5gemma/modeling_t5gemma.py (T5GemmaEncoder, T5GemmaDecoder,
T5GemmaCrossAttention, T5GemmaForConditionalGeneration) and masking_utils.py
(sliding_window_bidirectional_overlay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import gemma2
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

StackArgs = gemma2.ModelArgs  # a T5GemmaModuleConfig's fields are Gemma 2's

# What each stack's config must give (the rest have T5GemmaModuleConfig's defaults).
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def stack_args(config: Any, family: str, name: str, stack_type: type) -> Any:
    """A stack's `stack_type` (Gemma 2's or Gemma 3's ModelArgs) of `config`, the part of a
    `family` config.json called `name`."""
    if not isinstance(config, dict):
        raise ModelFormatError(f"the {family} config.json has no {name}")
    missing = [k for k in REQUIRED if config.get(k) is None]
    if missing:
        raise ModelFormatError(f"the {family} config.json's {name} has no {', '.join(missing)}")
    return stack_type.from_config(config)


def start_token(config: dict[str, Any], family: str, vocab_size: int) -> int:
    """The token the decoder starts from: decoder_start_token_id, else bos_token_id (the
    config's, then its decoder's), as generate picks it."""
    start = config.get("decoder_start_token_id")
    for source in (config, config["decoder"]):
        start = source.get("bos_token_id") if start is None else start
    if not isinstance(start, int) or not 0 <= start < vocab_size:
        raise ModelFormatError(f"the {family} config.json: decoder start token {start!r}")
    return start


@dataclass
class ModelArgs:
    """A T5GemmaConfig: its encoder's and decoder's T5GemmaModuleConfig, and the token the
    decoder starts from (decoder_start_token_id, else bos_token_id, as generate picks it)."""

    encoder: StackArgs
    decoder: StackArgs
    decoder_start_token_id: int

    def __post_init__(self) -> None:
        # What llmrun's KV cache (the decoder's self-attention) and the sampler read.
        self.num_hidden_layers = self.decoder.num_hidden_layers
        self.num_key_value_heads = self.decoder.num_key_value_heads
        self.head_dim = self.decoder.head_dim
        self.vocab_size = self.decoder.vocab_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        encoder, decoder = (
            stack_args(config.get(name), "T5Gemma", name, StackArgs)
            for name in ("encoder", "decoder")
        )
        return cls(encoder, decoder, start_token(config, "T5Gemma", decoder.vocab_size))


class CrossAttention(nn.Module):
    """Queries of the decoder's positions over the encoding's keys and values: no RoPE,
    scores scaled and soft-capped as the self-attention's."""

    def __init__(self, args: StackArgs, encoder_width: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.scale = args.query_pre_attn_scalar**-0.5
        self.softcap = args.attn_logit_softcapping
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(encoder_width, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(encoder_width, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)

    def keys_values(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoding's keys and values [1, Hkv, S, D] each."""
        b, s, _ = encoded.shape
        k = self.k_proj(encoded).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(encoded).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return k.contiguous(), v.contiguous()

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        return self.o_proj(attention(q, k, v, None, self.scale, self.softcap))


class EncoderLayer(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, args: StackArgs, layer: int) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = gemma2.Attention(args, layer)
        self.pre_self_attn_layernorm = GemmaRMSNorm(dim, eps)
        self.post_self_attn_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = GatedMLP(args)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, frames: dict[str, Frame]) -> torch.Tensor:
        return self.feed_forward(self.attend(x, frames))

    def attend(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None = None
    ) -> torch.Tensor:
        attended = self.self_attn(self.pre_self_attn_layernorm(x), frames, cache)
        return x + self.post_self_attn_layernorm(attended)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderLayer(EncoderLayer):
    """EncoderLayer's parts with a cross-attention (and its two norms) between them."""

    def __init__(self, args: StackArgs, layer: int, encoder_width: int) -> None:
        super().__init__(args, layer)
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.cross_attn = CrossAttention(args, encoder_width)
        self.pre_cross_attn_layernorm = GemmaRMSNorm(dim, eps)
        self.post_cross_attn_layernorm = GemmaRMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None,
        cross: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = self.attend(x, frames, cache)
        attended = self.cross_attn(self.pre_cross_attn_layernorm(x), *cross)
        return self.feed_forward(x + self.post_cross_attn_layernorm(attended))


class Stack(nn.Module):
    """T5GemmaEncoder's or T5GemmaDecoder's modules: embedding, layers, norm, RoPE."""

    def __init__(self, args: StackArgs, encoder_width: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            EncoderLayer(args, i) if encoder_width is None else DecoderLayer(args, i, encoder_width)
            for i in range(args.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    def causal_frames(
        self, positions: torch.Tensor, cache: KVCache | None, dtype: torch.dtype
    ) -> dict[str, Frame]:
        """A decoder's frames, by layer type, of tokens at `positions` after those `cache`
        holds."""
        return layer_frames(positions, cache, dtype, self.args.sliding_window, self.rotary_emb)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale rounded to the compute dtype, as transformers does.
        return x * torch.tensor(self.args.hidden_size**0.5).to(x.dtype)


class Body(nn.Module):
    """T5GemmaModel: `encoder` and `decoder`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.encoder = Stack(args.encoder)
        self.decoder = Stack(args.decoder, encoder_width=args.encoder.hidden_size)


class Head(nn.Module):
    """T5GemmaLMHead: `out_proj`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.out_proj = nn.Linear(args.decoder.hidden_size, args.decoder.vocab_size, bias=False)


# Each decoder layer's cross-attention keys and values, [1, Hkv, prompt, D] each.
CrossCache = list[tuple[torch.Tensor, torch.Tensor]]


class Model(nn.Module):
    """T5GemmaForConditionalGeneration's modules under its names, without its generate."""

    text_to_text = True  # generated through llmrun.text_to_text, not the batching scheduler

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = Head(args)

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's output [1, S, hidden] of a prompt's ids [1, S]."""
        encoder = self.model.encoder
        x = encoder.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = encoder.rotary_emb(positions)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        length = input_ids.shape[1]
        distance = (positions[0, None, :] - positions[0, :, None]).abs()
        near = (distance <= encoder.args.sliding_window)[None, None]  # [1, 1, S, S]
        frames = {
            "full_attention": Frame(positions, 0, length, None, cos, sin),
            "sliding_attention": Frame(positions, 0, length, near, cos, sin),
        }
        for layer in encoder.layers:
            x = layer(x, frames)
        return encoder.norm(x)

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding."""
        return [layer.cross_attn.keys_values(encoded) for layer in self.model.decoder.layers]

    def decoding(self, encoded: torch.Tensor) -> Decoding:
        """The decoder, attending to `encoded` (a prompt's encode())."""
        return Decoding(self, self.cross_cache(encoded))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """The decoder's self-attention cache (its sliding layers' keys kept whole)."""
        return new_cache(self.args, batch, max_seq_len, dtype, device)


class Decoding(nn.Module):
    """A T5Gemma (or T5Gemma 2) decoder bound to one prompt's encoding, called as llmrun's
    language models are: logits of ids [1, T] at positions [1, T] after the tokens its KV
    cache holds."""

    def __init__(self, model: Model, cross: CrossCache) -> None:
        super().__init__()
        self.t5gemma, self.cross = model, cross

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Float32 logits [1, T, vocab] ([1, 1, vocab] with last_only)."""
        model = self.t5gemma
        decoder, args = model.model.decoder, model.args.decoder
        x = decoder.embed(input_ids)
        frames = decoder.causal_frames(positions, cache, x.dtype)
        for layer, cross in zip(decoder.layers, self.cross, strict=True):
            x = layer(x, frames, cache, cross)
        if last_only:
            x = x[:, -1:]
        logits = model.lm_head.out_proj(decoder.norm(x))
        cap = args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
