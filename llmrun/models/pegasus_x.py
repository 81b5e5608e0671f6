"""PEGASUS-X (PegasusXForConditionalGeneration: google/pegasus-x-large, -base and their
fine-tunes): PEGASUS for long inputs. Its encoder splits the source into blocks of
block_size tokens (the last one padded) and adds num_global_tokens learned global tokens:
each token attends to the global tokens and to its own block, each global token to all
global tokens and all tokens; every other layer (stagger_local_blocks) shifts the blocks by
half a block. Global tokens have their own norm before attention and share the layer's
feed-forward. The decoder is PEGASUS's, pre-norm with a final norm per stack, its attention
without biases. Positions are M2M100's sinusoids (llmrun.models.bart.fairseq_positions),
from row 0, computed in the model, never stored; the head is the shared embedding, without a
final_logits_bias.

`encode` runs the source once; `decoding(encoded)` is the decoder bound to it, called as any
llmrun language model is (ids, positions, KV cache), so llmrun.text_to_text drives it.

Reference: transformers/models/pegasus_x/modeling_pegasus_x.py
(PegasusXSinusoidalPositionalEmbedding, PegasusXGlobalLocalAttention, PegasusXEncoderLayer,
PegasusXEncoder.forward, PegasusXDecoderLayer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ContextOverflowError, ModelFormatError
from llmrun.models import bart
from llmrun.models.bart import CrossCache, args_of, check_stacks, fairseq_positions, run_decoder
from llmrun.models.base import activation
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    """A PegasusXConfig's fields, by its names."""

    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    decoder_start_token_id: int
    activation_function: str = "gelu"
    scale_embedding: bool = True
    max_position_embeddings: int = 16384
    num_global_tokens: int = 32
    block_size: int = 512
    stagger_local_blocks: bool = True
    model_type: str = "pegasus_x"

    def __post_init__(self) -> None:
        check_stacks(self)
        odd = self.stagger_local_blocks and self.block_size % 2  # half a block shifts them
        if self.block_size < 1 or odd or self.num_global_tokens < 1:
            raise ModelFormatError(
                f"block_size {self.block_size} (1 or more, even where blocks are staggered) or "
                f"num_global_tokens {self.num_global_tokens} (1 or more) is out of range"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        optional = [
            "activation_function",
            "scale_embedding",
            "max_position_embeddings",
            "num_global_tokens",
            "block_size",
            "stagger_local_blocks",
        ]
        return args_of(cls, config, optional)


class Attention(bart.Attention):
    """BART's attention without biases, and the encoder's global-local attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads, bias=False)

    def global_local(
        self, tokens: torch.Tensor, globals_: torch.Tensor, mask: torch.Tensor, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention outputs of `tokens` [1, L, dim] (L a multiple of `block`), each
        attending to the global tokens and its block, and of `globals_` [1, G, dim], each
        attending to all; `mask` [L]: 0 for a token, -inf for padding."""
        scale = self.head_dim**-0.5
        q, k, v = (self.split(p(tokens)) for p in (self.q_proj, self.k_proj, self.v_proj))
        gq, gk, gv = (self.split(p(globals_)) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, gq = q * scale, gq * scale
        count = globals_.shape[1]
        # Global tokens: keys and values of the global tokens, then of every token.
        scores = gq @ torch.cat([gk, k], dim=2).transpose(-1, -2)
        scores = scores + F.pad(mask, (count, 0))
        global_out = scores.softmax(-1) @ torch.cat([gv, v], dim=2)
        # Tokens: [1, H, L, hd] -> [1, H, blocks, block, hd]; the global keys, then the block's.
        heads, length, width = q.shape[1], q.shape[2], self.head_dim
        qb, kb, vb = (x.reshape(1, heads, length // block, block, width) for x in (q, k, v))
        scores = torch.cat([qb @ gk[:, :, None].transpose(-1, -2), qb @ kb.transpose(-1, -2)], -1)
        scores = scores + F.pad(mask.view(length // block, block), (count, 0))[None, None, :, None]
        probs = scores.softmax(-1)
        local_out = probs[..., :count] @ gv[:, :, None] + probs[..., count:] @ vb
        # [1, H, blocks, block, hd] -> [1, L, dim]
        local_out = local_out.permute(0, 2, 3, 1, 4).reshape(1, length, heads * width)
        global_out = global_out.transpose(1, 2).reshape(1, count, heads * width)
        return self.out_proj(local_out), self.out_proj(global_out)


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim = args.d_model
        self.self_attn = Attention(dim, args.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.global_self_attn_layer_norm = nn.LayerNorm(dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, args.encoder_ffn_dim)
        self.fc2 = nn.Linear(args.encoder_ffn_dim, dim)
        self.act = activation(args.act)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x plus the feed-forward of its norm (tokens and global tokens alike)."""
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, heads = args.d_model, args.decoder_attention_heads
        self.self_attn = Attention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = Attention(dim, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, args.decoder_ffn_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_dim, dim)
        self.act = activation(args.act)

    @staticmethod
    def residual(
        x: torch.Tensor, norm: nn.Module, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return x + sublayer(norm(x))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_global = nn.Embedding(args.num_global_tokens, args.d_model)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.encoder_layers))
        self.layer_norm = nn.LayerNorm(args.d_model)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.decoder_layers))
        self.layer_norm = nn.LayerNorm(args.d_model)


class Seq2Seq(nn.Module):
    """HF's PegasusXModel: the shared embedding and the two stacks."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = Encoder(args)
        self.decoder = Decoder(args)


class Model(bart.TextToText):
    """PegasusXForConditionalGeneration's modules under its names, without its generate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Seq2Seq(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.embed_scale = math.sqrt(args.d_model) if args.scale_embedding else 1.0

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings plus the positions' sinusoids, [B, T, d_model]."""
        last = int(positions.max())
        if last >= self.args.max_position_embeddings:
            raise ContextOverflowError(
                f"position {last} is past the model's {self.args.max_position_embeddings} positions"
            )
        x = self.model.shared(input_ids) * self.embed_scale
        return x + fairseq_positions(positions, self.args.d_model).to(x.dtype)

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's output [1, S, d_model] of a source's ids [1, S]."""
        args, encoder = self.args, self.model.encoder
        length, block = input_ids.shape[1], args.block_size
        x = self.embed(input_ids, torch.arange(length, device=input_ids.device)[None])
        padded = -(-length // block) * block
        x = F.pad(x, (0, 0, 0, padded - length))
        mask = x.new_zeros(padded)
        mask[length:] = -float("inf")
        globals_ = encoder.embed_global.weight[None]
        for index, layer in enumerate(encoder.layers):
            tokens = layer.self_attn_layer_norm(x)
            normed_globals = layer.global_self_attn_layer_norm(globals_)
            layer_mask, half = mask, block // 2
            staggered = args.stagger_local_blocks and index % 2 == 1
            if staggered:  # blocks shifted by half a block: padding on either side
                tokens = F.pad(tokens, (0, 0, half, half))
                layer_mask = F.pad(mask, (half, half), value=-float("inf"))
            out, global_out = layer.self_attn.global_local(
                tokens, normed_globals, layer_mask, block
            )
            if staggered:
                out = out[:, half:-half]
            x, globals_ = layer.feed_forward(x + out), layer.feed_forward(globals_ + global_out)
        return encoder.layer_norm(x[:, :length])

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
        decoder = self.model.decoder
        x = self.embed(input_ids, positions)
        x = run_decoder(decoder.layers, x, positions, cache, cross)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(decoder.layer_norm(x)).float()
