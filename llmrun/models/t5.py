"""T5 text-to-text models (T5ForConditionalGeneration: t5 v1.0, v1.1, flan-t5, and
MT5ForConditionalGeneration, UMT5ForConditionalGeneration): an encoder of the prompt and a
decoder that attends to it. Both stacks are pre-norm layers with RMS norms without a mean
(T5LayerNorm), attention without biases or score scaling whose only positions are a learned
bias per head and relative-position bucket (bidirectional in the encoder, causal in the
decoder; the first layer's table serves every layer, UMT5's layers have a table each), and
a feed-forward of ReLU (v1.0) or gated GELU (v1.1, flan, mT5, UMT5). The decoder's output is
scaled by d_model**-0.5 before the head where the checkpoint ties the head to the
embedding (v1.0: scale_decoder_outputs).

LongT5 (longt5) is T5 whose encoder attends locally: each token to those within
local_radius either side, and with transient-global attention also to one key per
global_block_size tokens (their sum, normed), with a bias table of its own for those (both
tables the first layer's); its encoder runs block by block, as transformers' does, so a
long prompt costs memory in proportion to its length. Switch Transformers
(switch_transformers) is T5 v1.0 whose sparse layers' feed-forward is num_experts experts,
each token routed to its most probable one (its output scaled by that probability) unless
the expert already took expert_capacity tokens of the forward, when the token passes by.

`encode` runs the prompt once; `decoding(encoded)` is the decoder bound to that encoding,
called as any llmrun language model is (ids, positions, KV cache), so llmrun.generate's one
loop drives it (llmrun.text_to_text).

Reference: transformers/models/t5/modeling_t5.py (T5Attention._relative_position_bucket,
compute_bias, T5LayerNorm, T5DenseActDense, T5DenseGatedActDense, T5ForConditionalGeneration)
and models/umt5/modeling_umt5.py; models/longt5/modeling_longt5.py (LongT5LocalAttention,
LongT5TransientGlobalAttention, _make_global_fixed_block_ids) and
models/switch_transformers/modeling_switch_transformers.py (SwitchTransformersTop1Router,
SwitchTransformersSparseMLP, SwitchTransformersStack's sparse layers).
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
    # LongT5: "local" or "transient-global" (None: T5's full attention)
    encoder_attention_type: str | None = None
    local_radius: int = 127
    global_block_size: int = 16
    # Switch Transformers: experts of the sparse layers (0: none), which layers are sparse
    num_experts: int = 0
    expert_capacity: int = 64
    router_bias: bool = False
    encoder_sparse_step: int = 0
    decoder_sparse_step: int = 0

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
        if self.encoder_attention_type not in (None, "local", "transient-global"):
            raise ModelFormatError(
                f"encoder_attention_type {self.encoder_attention_type!r}: LongT5's are local "
                "or transient-global"
            )
        if self.num_experts and self.gated:
            raise ModelFormatError("Switch Transformers' experts are not gated")
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
        extra: dict[str, Any] = {}
        if model_type == "longt5":
            extra["encoder_attention_type"] = config.get("encoder_attention_type") or "local"
            for name in ("local_radius", "global_block_size"):
                if config.get(name) is not None:
                    extra[name] = config[name]
        if model_type == "switch_transformers":
            extra = _switch_fields(config)
            # SwitchTransformersForConditionalGeneration scales where the head is tied.
            scale = config.get("tie_word_embeddings") is not False
        values = {name: config[name] for name in names}
        values.update({name: config[name] for name in optional if config.get(name) is not None})
        values.update(extra)
        return cls(
            **values,
            scale_decoder_outputs=bool(scale) and model_type != "mt5",
            bias_per_layer=model_type == "umt5",
        )

    def sparse(self, index: int, decoder: bool) -> bool:
        """Whether layer `index` of a stack has experts (Switch Transformers' rule)."""
        step = self.decoder_sparse_step if decoder else self.encoder_sparse_step
        return bool(self.num_experts) and step > 0 and (index % step == 1 or step == 1)


def _switch_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A SwitchTransformersConfig's experts, as ModelArgs fields: its feed-forward's
    activation (dense_act_fn) and which layers are sparse (every
    num_layers // num_sparse_*_layers-th, from the second)."""
    layers = config["num_layers"]
    decoder_layers = config.get("num_decoder_layers") or layers
    fields: dict[str, Any] = {
        "feed_forward_proj": config.get("dense_act_fn") or "relu",
        "num_experts": config.get("num_experts", 8),
    }
    for name in ("expert_capacity", "router_bias"):
        if config.get(name) is not None:
            fields[name] = config[name]
    for stack, count in (("encoder", layers), ("decoder", decoder_layers)):
        sparse = config.get(f"num_sparse_{stack}_layers", 3)
        # transformers' step, its "no sparse layer" case (which still makes layer 1 sparse) too
        fields[f"{stack}_sparse_step"] = count // sparse if sparse > 0 else count
    return fields


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


class GlobalAttention(Attention):
    """LongT5's transient-global attention: T5's projections, a norm of the global inputs
    (every layer's own) and, beside the first layer's bias table, one for the global keys."""

    def __init__(self, args: ModelArgs, has_bias_table: bool) -> None:
        super().__init__(args, has_bias_table)
        self.global_input_layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)
        if has_bias_table:
            self.global_relative_attention_bias = nn.Embedding(
                args.relative_attention_num_buckets, args.num_heads
            )


# The encoder's self-attention under transformers' name, by LongT5's encoder_attention_type.
ENCODER_ATTENTION = {
    None: ("SelfAttention", Attention),
    "local": ("LocalSelfAttention", Attention),
    "transient-global": ("TransientGlobalSelfAttention", GlobalAttention),
}


class SelfAttentionLayer(nn.Module):
    """`SelfAttention` (LongT5's encoder: `LocalSelfAttention` or
    `TransientGlobalSelfAttention`) and its norm."""

    def __init__(self, args: ModelArgs, has_bias_table: bool, kind: str | None = None) -> None:
        super().__init__()
        self.name, attention_class = ENCODER_ATTENTION[kind]
        setattr(self, self.name, attention_class(args, has_bias_table))
        self.layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)

    @property
    def attention(self) -> Attention:
        return getattr(self, self.name)


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


class Router(nn.Module):
    """SwitchTransformersTop1Router: `classifier`, the experts' logits."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.classifier = nn.Linear(args.d_model, args.num_experts, bias=args.router_bias)


class SparseMLP(nn.Module):
    """Switch Transformers' experts: each token through its most probable expert, scaled
    by that probability, unless the expert took expert_capacity earlier tokens of the
    forward already (then the token gets nothing, and passes by on the residual)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.capacity = args.expert_capacity
        self.router = Router(args)
        self.experts = nn.ModuleDict(
            {f"expert_{i}": DenseReluDense(args) for i in range(args.num_experts)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The router in float32, as transformers' router_dtype has it.
        probs = torch.softmax(self.router.classifier(x).float(), dim=-1)
        weight, expert = probs.max(dim=-1)  # [B, T] each
        chosen = nn.functional.one_hot(expert, len(self.experts))  # [B, T, E]
        # A token's place in its expert's queue: past the capacity, it is dropped.
        kept = (chosen.cumsum(dim=1) * chosen).sum(-1) <= self.capacity
        out = torch.zeros_like(x)
        for index, module in enumerate(self.experts.values()):
            rows = (expert == index) & kept
            if rows.any():
                out[rows] = module(x[rows]) * weight[rows, None].to(x.dtype)
        return out


class FeedForwardLayer(nn.Module):
    """The norm and `DenseReluDense` (Switch Transformers: `mlp`, dense or experts)."""

    def __init__(self, args: ModelArgs, sparse: bool = False) -> None:
        super().__init__()
        if args.num_experts:
            self.mlp = SparseMLP(args) if sparse else DenseReluDense(args)
        else:
            self.DenseReluDense = DenseReluDense(args)
        self.layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self.mlp if hasattr(self, "mlp") else self.DenseReluDense
        return x + dense(self.layer_norm(x))


class Block(nn.Module):
    """HF's T5Block: `layer` holds self-attention, [cross-attention,] feed-forward."""

    def __init__(self, args: ModelArgs, index: int, decoder: bool) -> None:
        super().__init__()
        table = index == 0 or args.bias_per_layer
        kind = None if decoder else args.encoder_attention_type
        parts: list[nn.Module] = [SelfAttentionLayer(args, table, kind)]
        if decoder:
            parts.append(CrossAttentionLayer(args))
        parts.append(FeedForwardLayer(args, args.sparse(index, decoder)))
        self.layer = nn.ModuleList(parts)


class Stack(nn.Module):
    def __init__(self, args: ModelArgs, layers: int, decoder: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(Block(args, i, decoder) for i in range(layers))
        self.final_layer_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)

    def biases(self, buckets: torch.Tensor) -> list[torch.Tensor]:
        """Each block's self-attention bias [B, heads, T, L] of buckets [B, T, L]: the
        first block's for all (T5), or each block's own (UMT5)."""
        tables = [b.layer[0].attention for b in self.block]
        if hasattr(tables[-1], "relative_attention_bias"):
            return [t.bias(buckets) for t in tables]
        return [tables[0].bias(buckets)] * len(tables)


def _heads(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """[1, S, heads * d_kv] (or [S, ...]) -> [heads, S, d_kv]."""
    return x.reshape(-1, attn.heads, attn.head_dim).transpose(0, 1)


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [H, S, D] with zero rows after its S, to `length` rows."""
    return nn.functional.pad(x, (0, 0, 0, length - x.shape[1]))


def _three_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[H, S, D] -> [H, blocks, 3 * block, D]: each block of `block` rows with the blocks
    before and after it (zero rows past the ends)."""
    blocks = -(-x.shape[1] // block)
    x = nn.functional.pad(x, (0, 0, block, (blocks + 1) * block - x.shape[1]))
    x = x.unflatten(1, (blocks + 2, block))
    return torch.cat((x[:, :-2], x[:, 1:-1], x[:, 2:]), dim=2)


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
        if self.args.encoder_attention_type is not None:
            return self._encode_local(input_ids)
        x = self.shared(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # [S] -> [1, S, S]: key - query for each pair
        relative = (positions[None, :] - positions[:, None])[None]
        biases = self.encoder.biases(self._buckets(relative, bidirectional=True))
        for block, bias in zip(self.encoder.block, biases, strict=True):
            part = block.layer[0]
            attn = part.attention
            h = part.layer_norm(x)
            q, k, v = attn.split(attn.q(h)), attn.split(attn.k(h)), attn.split(attn.v(h))
            x = x + attn.o(attention(q, k, v, bias.to(h.dtype), 1.0))
            x = block.layer[1](x)
        return self.encoder.final_layer_norm(x)

    def _encode_local(self, input_ids: torch.Tensor) -> torch.Tensor:
        """LongT5's encoder: blocks of local_radius + 1 queries, each attending to its
        block and the two beside it within local_radius (the first layer's bias of the
        distance), and with transient-global attention to the global keys too."""
        args = self.args
        x = self.shared(input_ids)
        length, block = input_ids.shape[1], args.local_radius + 1
        blocks = -(-length // block)
        first = self.encoder.block[0].layer[0].attention
        # [block, 3 * block]: key - query within a query's three blocks
        spots = torch.arange(3 * block, device=x.device)
        relative = spots[None, :] - (spots[block : 2 * block, None])
        local = first.bias(self._buckets(relative[None], bidirectional=True))[0][:, None]
        keys = (torch.arange(blocks, device=x.device)[:, None] - 1) * block + spots
        # [blocks, block, 3 * block]: a key within the radius, inside the prompt
        seen = (relative.abs() < block) & (keys >= 0)[:, None] & (keys < length)[:, None]
        local = local.masked_fill(~seen, float("-inf")).to(x.dtype)  # [H, blocks, block, 3B]
        side = None  # a prompt shorter than a global block has no global keys
        if args.encoder_attention_type == "transient-global" and length >= args.global_block_size:
            ids, side = self._global_side(first, length, blocks * block)
        for block_module in self.encoder.block:
            part = block_module.layer[0]
            attn, h = part.attention, part.layer_norm(x)
            q, k, v = (_heads(attn, proj(h)) for proj in (attn.q, attn.k, attn.v))
            k, v = _three_blocks(k, block), _three_blocks(v, block)
            q = _pad_to(q, blocks * block).unflatten(1, (blocks, block))
            scores = q @ k.transpose(-1, -2) + local  # [H, blocks, block, 3B]
            if side is not None:  # [G, d_model]: the sum of each global block, normed
                sums = torch.zeros(side.shape[-1], h.shape[-1], dtype=h.dtype, device=h.device)
                sums = attn.global_input_layer_norm(sums.index_add(0, ids, h[0]))
                global_k, global_v = _heads(attn, attn.k(sums)), _heads(attn, attn.v(sums))
                scores = torch.cat((scores, q @ global_k[:, None].transpose(-1, -2) + side), -1)
                k = torch.cat((k, global_k[:, None].expand(-1, blocks, -1, -1)), dim=2)
                v = torch.cat((v, global_v[:, None].expand(-1, blocks, -1, -1)), dim=2)
            weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            # [H, blocks, block, d_kv] -> [1, S, H * d_kv]
            out = (weights @ v).flatten(1, 2)[:, :length].transpose(0, 1).flatten(1)[None]
            x = block_module.layer[1](x + attn.o(out))
        return self.encoder.final_layer_norm(x)

    def _global_side(
        self, first: Attention, length: int, padded: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transient-global attention's global blocks of a prompt of `length` tokens:
        each token's block [S] (the tokens of a last, partial block join the one before),
        and the bias of a query's distance to each global block (the first layer's global
        table) [H, blocks of queries, block, global blocks], zero rows after the prompt up
        to `padded` queries."""
        size, device = (
            self.args.global_block_size,
            first.global_relative_attention_bias.weight.device,
        )
        count = length // size
        ids = (torch.arange(length, device=device) // size).clamp(max=count - 1)
        relative = torch.arange(count, device=device)[None, :] - ids[:, None]  # [S, G]
        buckets = self._buckets(relative[None], bidirectional=True)
        bias = first.global_relative_attention_bias(buckets)[0].permute(2, 0, 1)  # [H, S, G]
        block = self.args.local_radius + 1
        return ids, _pad_to(bias, padded).unflatten(1, (padded // block, block))

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
