"""BART-family text-to-text models: BART (BartForConditionalGeneration: facebook/bart-*,
bart-large-cnn, sshleifer/distilbart-*), mBART (MBartForConditionalGeneration: mbart-large-50
and its translators), Marian (MarianMTModel: Helsinki-NLP/opus-mt-*) and M2M100
(M2M100ForConditionalGeneration: facebook/m2m100_*, facebook/nllb-200-*). An encoder of the
source text and a decoder that attends to it, with biased q, k, v, out projections, queries
scaled by head_dim**-0.5, a feed-forward of fc1, the activation, fc2, the token embedding
(scaled by sqrt(d_model) where scale_embedding says) plus positions, and the head tied to the
shared embedding plus final_logits_bias (zero for M2M100, which has none). The families
differ in three places:
- positions: BART's and mBART's a learned table per stack read two rows on (their offset 2);
  Marian's sinusoids (sines in the first half of each vector, cosines in the second);
  M2M100's fairseq sinusoids, also two rows on;
- BART and mBART normalize the embeddings (layernorm_embedding), Marian and M2M100 do not;
- BART and Marian normalize after each residual (post-norm); mBART and M2M100 before each
  sublayer, and once more at the end of each stack (layer_norm).

`encode` runs the source once; `decoding(encoded)` is the decoder bound to it, called as any
llmrun language model is (ids, positions, KV cache), so llmrun.text_to_text drives it as it
drives T5.

Reference: transformers/models/bart/modeling_bart.py (BartLearnedPositionalEmbedding,
BartEncoderLayer, BartDecoderLayer), models/mbart/modeling_mbart.py (MBartEncoderLayer: the
norms first), models/marian/modeling_marian.py (MarianSinusoidalPositionalEmbedding),
models/m2m_100/modeling_m2m_100.py (M2M100SinusoidalPositionalEmbedding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError
from llmrun.models.base import (
    Frame,
    activation,
    attend,
    attention,
    attention_mask,
    key_positions,
    new_cache,
)
from llmrun.models.cache import KVCache

MODEL_TYPES = ("bart", "mbart", "marian", "m2m_100")
POSITION_OFFSET = 2  # BART's and mBART's learned tables: position p is row p + 2


@dataclass
class ModelArgs:
    """A BartConfig's (MBartConfig's, MarianConfig's) fields, by its names."""

    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    decoder_start_token_id: int
    activation_function: str = "gelu"  # the configs' default; opus-mt files say "swish"
    scale_embedding: bool = False
    max_position_embeddings: int = 1024
    model_type: str = "bart"

    def __post_init__(self) -> None:
        for side in ("encoder", "decoder"):
            if self.d_model % getattr(self, f"{side}_attention_heads"):
                raise ModelFormatError(
                    f"d_model {self.d_model} is not a multiple of {side}_attention_heads"
                )
        # transformers' ACT2FN: "swish" is SiLU.
        self.act = "silu" if self.activation_function == "swish" else self.activation_function
        activation(self.act)  # refuses an unknown one
        self.sinusoidal = self.model_type in ("marian", "m2m_100")
        self.embedding_norm = self.model_type in ("bart", "mbart")
        self.pre_norm = self.model_type in ("mbart", "m2m_100")
        # What llmrun's KV cache (the decoder's self-attention) reads.
        self.num_hidden_layers = self.decoder_layers
        self.num_key_value_heads = self.decoder_attention_heads
        self.head_dim = self.d_model // self.decoder_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = [
            "vocab_size",
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "decoder_start_token_id",
        ]
        missing = [name for name in names if config.get(name) is None]
        if missing:
            raise ModelFormatError(f"the config.json has no {', '.join(missing)}")
        if config.get("share_encoder_decoder_embeddings") is False:
            raise UnsupportedError(
                "a Marian model with separate source and target vocabularies is not supported"
            )
        optional = [
            "activation_function",
            "scale_embedding",
            "max_position_embeddings",
            "model_type",
        ]
        return cls(
            **{name: config[name] for name in names},
            **{name: config[name] for name in optional if config.get(name) is not None},
        )


def sinusoidal_positions(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Marian's position vectors [..., dim] of `positions`: position / 10000**(2*(j//2)/dim)
    at each j, the sines of the even j then the cosines of the odd j; computed in float64 and
    rounded to float32, as transformers fills its table."""
    j = torch.arange(dim, dtype=torch.float64, device=positions.device)
    angles = positions[..., None].double() / torch.pow(
        10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim
    )
    return torch.cat([angles[..., 0::2].sin(), angles[..., 1::2].cos()], dim=-1).float()


def fairseq_positions(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """M2M100's (fairseq's) position vectors [..., dim] of table rows `positions`: the
    sines of position * 10000**(-i/(dim/2 - 1)) for i below dim/2, then their cosines, in
    float32 as transformers computes its table (M2M100SinusoidalPositionalEmbedding); a
    zero column after them where dim is odd. Row p + 2 is position p (the padding_idx 1 row
    and the one before it are never read for a text without padding)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, device=positions.device).float() * -step)
    angles = positions[..., None].float() * freqs
    out = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if dim % 2:
        out = torch.cat([out, out.new_zeros(*out.shape[:-1], 1)], dim=-1)
    return out


class Attention(nn.Module):
    """q_proj, k_proj, v_proj, out_proj with biases; softmax(q k^T / sqrt(head_dim)) v."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, dim] -> [B, heads, T, head_dim]."""
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)


class Layer(nn.Module):
    """An encoder layer (self-attention, feed-forward) or, with `decoder`, a decoder layer
    (self-attention, cross-attention, feed-forward); each sublayer's residual normalized
    after it (post-norm), or the sublayer's input normalized (mBART's pre-norm)."""

    def __init__(self, args: ModelArgs, decoder: bool) -> None:
        super().__init__()
        side = "decoder" if decoder else "encoder"
        dim, heads = args.d_model, getattr(args, f"{side}_attention_heads")
        ffn = getattr(args, f"{side}_ffn_dim")
        self.pre_norm = args.pre_norm
        self.self_attn = Attention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        if decoder:
            self.encoder_attn = Attention(dim, heads)
            self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.act = activation(args.act)

    def residual(
        self, x: torch.Tensor, norm: nn.Module, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """x plus sublayer(x), normalized where the family normalizes."""
        if self.pre_norm:
            return x + sublayer(norm(x))
        return norm(x + sublayer(x))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Stack(nn.Module):
    """An encoder or decoder: its layers, its learned positions (BART, mBART), the
    embeddings' norm (BART, mBART) and the final norm (mBART)."""

    def __init__(self, args: ModelArgs, layers: int, decoder: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(args, decoder) for _ in range(layers))
        if not args.sinusoidal:
            rows = args.max_position_embeddings + POSITION_OFFSET
            self.embed_positions = nn.Embedding(rows, args.d_model)
        if args.embedding_norm:
            self.layernorm_embedding = nn.LayerNorm(args.d_model)
        if args.pre_norm:
            self.layer_norm = nn.LayerNorm(args.d_model)


class Seq2Seq(nn.Module):
    """HF's BartModel (MBartModel, MarianModel): the shared embedding and the two stacks."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = Stack(args, args.encoder_layers, decoder=False)
        self.decoder = Stack(args, args.decoder_layers, decoder=True)


# Each decoder layer's cross-attention keys and values, [1, heads, source, head_dim] each.
CrossCache = list[tuple[torch.Tensor, torch.Tensor]]


class Model(nn.Module):
    """BartForConditionalGeneration's (MBart's, MarianMTModel's) modules under its names,
    without its generate."""

    text_to_text = True  # generated through llmrun.text_to_text, not the batching scheduler

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Seq2Seq(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, args.vocab_size))
        self.embed_scale = math.sqrt(args.d_model) if args.scale_embedding else 1.0

    def embed(self, stack: Stack, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A stack's input [B, T, d_model]: the scaled token embeddings plus the positions',
        normalized where the family normalizes them."""
        last = int(positions.max())
        if last >= self.args.max_position_embeddings:
            raise ContextOverflowError(
                f"position {last} is past the model's {self.args.max_position_embeddings} positions"
            )
        x = self.model.shared(input_ids) * self.embed_scale
        if self.args.model_type == "m2m_100":
            x = x + fairseq_positions(positions + POSITION_OFFSET, self.args.d_model).to(x.dtype)
        elif self.args.sinusoidal:
            x = x + sinusoidal_positions(positions, self.args.d_model).to(x.dtype)
        else:
            x = x + stack.embed_positions(positions + POSITION_OFFSET)
        return stack.layernorm_embedding(x) if self.args.embedding_norm else x

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's output [1, S, d_model] of a source's ids [1, S]."""
        stack = self.model.encoder
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed(stack, input_ids, positions)
        for layer in stack.layers:

            def attend_all(h: torch.Tensor, attn: Attention = layer.self_attn) -> torch.Tensor:
                q, k, v = (
                    attn.split(attn.q_proj(h)),
                    attn.split(attn.k_proj(h)),
                    attn.split(attn.v_proj(h)),
                )
                return attn.out_proj(attention(q, k, v, None, attn.head_dim**-0.5))

            x = layer.residual(x, layer.self_attn_layer_norm, attend_all)
            x = layer.residual(x, layer.final_layer_norm, layer.feed_forward)
        return stack.layer_norm(x) if self.args.pre_norm else x

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding."""
        out = []
        for layer in self.model.decoder.layers:
            attn = layer.encoder_attn
            k, v = attn.split(attn.k_proj(encoded)), attn.split(attn.v_proj(encoded))
            out.append((k.contiguous(), v.contiguous()))
        return out

    def decoding(self, encoded: torch.Tensor) -> Decoding:
        """The decoder, attending to `encoded` (a source's encode())."""
        return Decoding(self, self.cross_cache(encoded))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """The decoder's self-attention cache."""
        return new_cache(self.args, batch, max_seq_len, dtype, device)


class Decoding(nn.Module):
    """A decoder bound to one source's encoding, called as llmrun's language models are:
    logits of ids [1, T] at positions [1, T] after the tokens its KV cache holds."""

    def __init__(self, model: Model, cross: CrossCache) -> None:
        super().__init__()
        self.bart, self.cross = model, cross

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Float32 logits [1, T, vocab] ([1, 1, vocab] with last_only)."""
        model = self.bart
        stack = model.model.decoder
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        x = model.embed(stack, input_ids, positions)
        keys = key_positions(positions, length, cache)
        no_rope = positions.new_zeros(0, dtype=x.dtype)
        frame = Frame(positions, start, length, attention_mask(positions, keys), no_rope, no_rope)
        for index, layer in enumerate(stack.layers):

            def attend_own(
                h: torch.Tensor, attn: Attention = layer.self_attn, index: int = index
            ) -> torch.Tensor:
                q, k, v = (
                    attn.split(attn.q_proj(h)),
                    attn.split(attn.k_proj(h)),
                    attn.split(attn.v_proj(h)),
                )
                return attn.out_proj(attend(q, k, v, index, frame, cache))

            def attend_source(
                h: torch.Tensor, attn: Attention = layer.encoder_attn, index: int = index
            ) -> torch.Tensor:
                q = attn.split(attn.q_proj(h))
                return attn.out_proj(attention(q, *self.cross[index], None, attn.head_dim**-0.5))

            x = layer.residual(x, layer.self_attn_layer_norm, attend_own)
            x = layer.residual(x, layer.encoder_attn_layer_norm, attend_source)
            x = layer.residual(x, layer.final_layer_norm, layer.feed_forward)
        if last_only:
            x = x[:, -1:]
        if model.args.pre_norm:
            x = stack.layer_norm(x)
        return (model.lm_head(x) + model.final_logits_bias).float()
