"""T5 text-to-text models (T5ForConditionalGeneration: t5 v1.0, v1.1, flan-t5, and
MT5ForConditionalGeneration, UMT5ForConditionalGeneration): an encoder of the prompt and a
decoder that attends to it. Both stacks are pre-norm layers with RMS norms without a mean
(T5LayerNorm), attention without biases or score scaling whose only positions are a learned
bias per head and relative-position bucket (bidirectional in the encoder, causal in the
decoder; the first layer's table serves every layer, UMT5's layers have a table each), and
a feed-forward of ReLU (v1.0) or gated GELU (v1.1, flan, mT5, UMT5). The decoder's output is
scaled by d_model**-0.5 before the head where the checkpoint ties the head to the
embedding (v1.0: scale_decoder_outputs).

`encode` runs the prompt once; `decoding(encoded)` is the decoder bound to that encoding,
called as any llmrun language model is (ids, positions, KV cache), so llmrun.generate's one
loop drives it (llmrun.text_to_text).

Reference: transformers/models/t5/modeling_t5.py (T5Attention._relative_position_bucket,
compute_bias, T5LayerNorm, T5DenseActDense, T5DenseGatedActDense, T5ForConditionalGeneration)
and models/umt5/modeling_umt5.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import (
    Frame,
    RMSNorm,
    activation,
    attend_biased,
    attention,
    key_positions,
    new_cache,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    """A T5Config's (MT5Config's, UMT5Config's) fields, by its names."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_decoder_layers: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    decoder_start_token_id: int = 0
    scale_decoder_outputs: bool = True
    bias_per_layer: bool = False  # UMT5: every layer's attention has its own bias table

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        kind = self.feed_forward_proj.split("-")
        if len(kind) > 2 or (len(kind) == 2 and kind[0] != "gated"):
            raise ModelFormatError(
                f"feed_forward_proj {self.feed_forward_proj!r}: T5's are ACT or gated-ACT"
            )
        self.gated = len(kind) == 2
        # transformers' T5Config: "gated-gelu" is the tanh GELU (gelu_new).
        self.act = "gelu_new" if self.feed_forward_proj == "gated-gelu" else kind[-1]
        activation(self.act)  # refuses an unknown one
        # What llmrun's KV cache (the decoder's self-attention) reads.
        self.num_hidden_layers = self.num_decoder_layers
        self.num_key_value_heads = self.num_heads
        self.head_dim = self.d_kv

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = ["vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"]
        missing = [name for name in names if config.get(name) is None]
        if missing:
            raise ModelFormatError(f"the T5 config.json has no {', '.join(missing)}")
        optional = [
            "num_decoder_layers",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
            "layer_norm_epsilon",
            "feed_forward_proj",
            "decoder_start_token_id",
        ]
        model_type = config.get("model_type")
        # transformers 5's rule: scale_decoder_outputs where saved, else unless the file
        # unties the head (v1.1 and flan say tie_word_embeddings false); mT5 never scales.
        scale = config.get("scale_decoder_outputs")
        if scale is None:
            scale = config.get("tie_word_embeddings") is not False
        return cls(
            **{name: config[name] for name in names},
            **{name: config[name] for name in optional if config.get(name) is not None},
            scale_decoder_outputs=bool(scale) and model_type != "mt5",
            bias_per_layer=model_type == "umt5",
        )


def relative_buckets(
    relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int
) -> torch.Tensor:
    """Each relative position (key - query) -> its bucket, as mesh-tensorflow's T5 bins
    them: exact below half the buckets (of each direction, bidirectionally), then
    logarithmic up to max_distance, beyond which all share the last bucket."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        bucket = bucket + (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = buckets // 2
    # transformers' order of operations, in float32: a bucket edge falls where its does.
    ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = (exact + (ratio * (buckets - exact)).long()).clamp(max=buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class Attention(nn.Module):
    """q, k, v, o without biases; scores q·k unscaled, plus the position bias."""

    def __init__(self, args: ModelArgs, has_bias_table: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = args.num_heads, args.d_kv
        inner = args.num_heads * args.d_kv
        self.q = nn.Linear(args.d_model, inner, bias=False)
        self.k = nn.Linear(args.d_model, inner, bias=False)
        self.v = nn.Linear(args.d_model, inner, bias=False)
        self.o = nn.Linear(inner, args.d_model, bias=False)
        if has_bias_table:
            self.relative_attention_bias = nn.Embedding(
                args.relative_attention_num_buckets, args.num_heads
            )

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, heads * d_kv] -> [B, heads, T, d_kv]."""
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def bias(self, buckets: torch.Tensor) -> torch.Tensor:
        """The table's bias [B, heads, T, L] of buckets [B, T, L]."""
        return self.relative_attention_bias(buckets).permute(0, 3, 1, 2)


class SelfAttentionLayer(nn.Module):
    def __init__(self, args: ModelArgs, has_bias_table: bool) -> None:
        super().__init__()
        self.SelfAttention = Attention(args, has_bias_table)
        self.layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)


class CrossAttentionLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.EncDecAttention = Attention(args, has_bias_table=False)
        self.layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)


class DenseReluDense(nn.Module):
    """wo(act(wi(x))), or gated: wo(act(wi_0(x)) * wi_1(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gated = args.gated
        if args.gated:
            self.wi_0 = nn.Linear(args.d_model, args.d_ff, bias=False)
            self.wi_1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        else:
            self.wi = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=False)
        self.act = activation(args.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))
        return self.wo(self.act(self.wi(x)))


class FeedForwardLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.DenseReluDense = DenseReluDense(args)
        self.layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class Block(nn.Module):
    """HF's T5Block: `layer` holds self-attention, [cross-attention,] feed-forward."""

    def __init__(self, args: ModelArgs, index: int, decoder: bool) -> None:
        super().__init__()
        table = index == 0 or args.bias_per_layer
        parts: list[nn.Module] = [SelfAttentionLayer(args, table)]
        if decoder:
            parts.append(CrossAttentionLayer(args))
        parts.append(FeedForwardLayer(args))
        self.layer = nn.ModuleList(parts)


class Stack(nn.Module):
    def __init__(self, args: ModelArgs, layers: int, decoder: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(Block(args, i, decoder) for i in range(layers))
        self.final_layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)

    def biases(self, buckets: torch.Tensor) -> list[torch.Tensor]:
        """Each block's self-attention bias [B, heads, T, L] of buckets [B, T, L]: the
        first block's for all (T5), or each block's own (UMT5)."""
        tables = [b.layer[0].SelfAttention for b in self.block]
        if hasattr(tables[-1], "relative_attention_bias"):
            return [t.bias(buckets) for t in tables]
        return [tables[0].bias(buckets)] * len(tables)


# Each decoder block's cross-attention keys and values, [1, heads, prompt, d_kv] each.
CrossCache = list[tuple[torch.Tensor, torch.Tensor]]


class Model(nn.Module):
    """T5ForConditionalGeneration's modules under its names, without its generate."""

    text_to_text = True  # generated through llmrun.text_to_text, not the batching scheduler

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = Stack(args, args.num_layers, decoder=False)
        self.decoder = Stack(args, args.num_decoder_layers, decoder=True)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)

    def _buckets(self, relative: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        args = self.args
        return relative_buckets(
            relative,
            bidirectional,
            args.relative_attention_num_buckets,
            args.relative_attention_max_distance,
        )

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's output [1, S, d_model] of a prompt's ids [1, S]."""
        x = self.shared(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # [S] -> [1, S, S]: key - query for each pair
        relative = (positions[None, :] - positions[:, None])[None]
        biases = self.encoder.biases(self._buckets(relative, bidirectional=True))
        for block, bias in zip(self.encoder.block, biases, strict=True):
            part = block.layer[0]
            attn = part.SelfAttention
            h = part.layer_norm(x)
            q, k, v = attn.split(attn.q(h)), attn.split(attn.k(h)), attn.split(attn.v(h))
            x = x + attn.o(attention(q, k, v, bias.to(h.dtype), 1.0))
            x = block.layer[1](x)
        return self.encoder.final_layer_norm(x)

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder block's cross-attention keys and values of an encoding."""
        out = []
        for block in self.decoder.block:
            attn = block.layer[1].EncDecAttention
            k, v = attn.split(attn.k(encoded)), attn.split(attn.v(encoded))
            out.append((k.contiguous(), v.contiguous()))
        return out

    def decoding(self, encoded: torch.Tensor) -> Decoding:
        """The decoder, attending to `encoded` (a prompt's encode())."""
        return Decoding(self, self.cross_cache(encoded))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """The decoder's self-attention cache."""
        return new_cache(self.args, batch, max_seq_len, dtype, device)


class Decoding(nn.Module):
    """A T5 decoder bound to one prompt's encoding, called as llmrun's language models are:
    logits of ids [1, T] at positions [1, T] after the tokens its KV cache holds."""

    def __init__(self, model: Model, cross: CrossCache) -> None:
        super().__init__()
        self.t5, self.cross = model, cross

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Float32 logits [1, T, vocab] ([1, 1, vocab] with last_only)."""
        t5 = self.t5
        x = t5.shared(input_ids)
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        keys = key_positions(positions, length, cache)
        # [B, T] and [B, L] -> [B, T, L]: key - query
        relative = keys[:, None, :] - positions[:, :, None]
        future = (relative > 0)[:, None]
        biases = t5.decoder.biases(t5._buckets(relative, bidirectional=False))
        no_rope = positions.new_zeros(0, dtype=x.dtype)
        for index, (block, bias) in enumerate(zip(t5.decoder.block, biases, strict=True)):
            mask = bias.masked_fill(future, float("-inf")).to(x.dtype)
            frame = Frame(positions, start, length, mask, no_rope, no_rope)
            part = block.layer[0]
            attn = part.SelfAttention
            h = part.layer_norm(x)
            q, k, v = attn.split(attn.q(h)), attn.split(attn.k(h)), attn.split(attn.v(h))
            x = x + attn.o(attend_biased(q, k, v, index, frame, cache, 1.0))
            part = block.layer[1]
            attn = part.EncDecAttention
            q = attn.split(attn.q(part.layer_norm(x)))
            x = x + attn.o(attention(q, *self.cross[index], None, 1.0))
            x = block.layer[2](x)
        if last_only:
            x = x[:, -1:]
        x = t5.decoder.final_layer_norm(x)
        if t5.args.scale_decoder_outputs:
            x = x * t5.args.d_model**-0.5
        return t5.lm_head(x).float()
