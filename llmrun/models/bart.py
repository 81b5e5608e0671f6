"""BART-family text-to-text models: BART (BartForConditionalGeneration: facebook/bart-*,
bart-large-cnn, sshleifer/distilbart-*), mBART (MBartForConditionalGeneration: mbart-large-50
and its translators), Marian (MarianMTModel: Helsinki-NLP/opus-mt-*), M2M100
(M2M100ForConditionalGeneration: facebook/m2m100_*, facebook/nllb-200-*), PEGASUS
(PegasusForConditionalGeneration: google/pegasus-xsum, -cnn_dailymail, -large), Blenderbot
(BlenderbotForConditionalGeneration: facebook/blenderbot-400M-distill, -1B-distill),
Blenderbot Small (facebook/blenderbot_small-90M), MVP (MvpForConditionalGeneration:
RUCAIBox/mvp, without its prompts) and LED (LEDForConditionalGeneration: allenai/led-*). An
encoder of the source text and a decoder that attends to it, with biased q, k, v, out
projections, queries scaled by head_dim**-0.5, a feed-forward of fc1, the activation, fc2,
the token embedding (scaled by sqrt(d_model) where scale_embedding says) plus positions,
and the head tied to the shared embedding plus final_logits_bias (zero for M2M100, which
has none). The families differ in four places (LAYOUTS):
- positions: a learned table per stack, read two rows on in BART's, mBART's and MVP's (their
  offset 2), from row 0 in Blenderbot's and LED's (LED's stacks have tables of their own
  lengths, max_encoder_position_embeddings and max_decoder_position_embeddings); sinusoids
  in Marian and PEGASUS (sines in the first half of each vector, cosines in the second);
  M2M100's fairseq sinusoids, two rows on;
- BART, mBART, MVP, LED and Blenderbot Small normalize the embeddings (layernorm_embedding);
  Blenderbot Small's decoder normalizes its token embeddings alone, unscaled, before adding
  the positions (as transformers does);
- BART, MVP, LED, Marian and Blenderbot Small normalize after each residual (post-norm);
  mBART, M2M100, PEGASUS and Blenderbot before each sublayer, and once more at the end of
  each stack (layer_norm);
- LED's encoder attends within a window (Longformer's sliding-window attention: each token
  to those attention_window / 2 either side; llmrun.loading.bart gives its tensors BART's
  names), the others' to the whole source.

Florence-2's language model is BART's: its encoder takes the image's tokens in place of their
placeholders (`encode`'s images, llmrun.florence2_images).

`encode` runs the source once; `decoding(encoded)` is the decoder bound to it, called as any
llmrun language model is (ids, positions, KV cache), so llmrun.text_to_text drives it as it
drives T5.

Reference: transformers/models/bart/modeling_bart.py (BartLearnedPositionalEmbedding,
BartEncoderLayer, BartDecoderLayer), models/mbart/modeling_mbart.py (MBartEncoderLayer: the
norms first), models/marian/modeling_marian.py (MarianSinusoidalPositionalEmbedding),
models/m2m_100/modeling_m2m_100.py (M2M100SinusoidalPositionalEmbedding),
models/pegasus/modeling_pegasus.py, models/blenderbot/modeling_blenderbot.py,
models/blenderbot_small/modeling_blenderbot_small.py (BlenderbotSmallDecoder.forward),
models/mvp/modeling_mvp.py, models/led/modeling_led.py (LEDEncoderSelfAttention without
global attention, LEDEncoder._pad_to_window_size).
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

POSITION_OFFSET = 2  # BART's, mBART's and MVP's learned tables: position p is row p + 2


@dataclass(frozen=True)
class Layout:
    """Where a family departs from BART: its positions ("learned" tables, Marian's
    "sinusoidal" ones, M2M100's "fairseq" ones), whether its learned tables are read
    POSITION_OFFSET rows on, whether it normalizes its embeddings, and whether it normalizes
    each sublayer's input (pre-norm, with a final norm per stack) rather than its residual."""

    positions: str = "learned"
    offset: bool = True
    embedding_norm: bool = True
    pre_norm: bool = False
    decoder_norms_tokens: bool = False  # Blenderbot Small's decoder: see Model.embed
    windowed: bool = False  # LED's encoder: each token attends to its attention_window


LAYOUTS = {
    "bart": Layout(),
    "mbart": Layout(pre_norm=True),
    "mvp": Layout(),
    "led": Layout(offset=False, windowed=True),
    "marian": Layout(positions="sinusoidal", embedding_norm=False),
    "m2m_100": Layout(positions="fairseq", embedding_norm=False, pre_norm=True),
    "pegasus": Layout(positions="sinusoidal", embedding_norm=False, pre_norm=True),
    "blenderbot": Layout(offset=False, embedding_norm=False, pre_norm=True),
    "blenderbot-small": Layout(offset=False, decoder_norms_tokens=True),
}


@dataclass
class ModelArgs:
    """A BartConfig's (or a kin's: MBartConfig, MarianConfig, PegasusConfig, ...) fields, by
    its names."""

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
    # LED's: each stack's positions, and each encoder layer's window (an int: every layer's)
    max_encoder_position_embeddings: int | None = None
    max_decoder_position_embeddings: int | None = None
    attention_window: int | list[int] | None = None
    # M2M100's fairseq positions are numbered from pad_token_id + 1 (SeamlessM4T's pad is 0)
    pad_token_id: int = 1

    def __post_init__(self) -> None:
        check_stacks(self)
        if self.model_type not in LAYOUTS:
            raise UnsupportedError(f"model_type {self.model_type!r} is not a BART-family model")
        self.layout = layout = LAYOUTS[self.model_type]
        self.sinusoidal = layout.positions != "learned"
        self.embedding_norm, self.pre_norm = layout.embedding_norm, layout.pre_norm
        self.encoder_positions = (
            self.max_encoder_position_embeddings or self.max_position_embeddings
        )
        self.decoder_positions = (
            self.max_decoder_position_embeddings or self.max_position_embeddings
        )
        self.windows: list[int] = []
        if layout.windowed:
            window = self.attention_window
            windows = [window] * self.encoder_layers if isinstance(window, int) else window
            if (
                not isinstance(windows, list)
                or len(windows) != self.encoder_layers
                or not all(isinstance(w, int) and w > 0 and w % 2 == 0 for w in windows)
            ):
                raise ModelFormatError(
                    f"attention_window {window!r}: an even number, or one per encoder layer"
                )
            self.windows = windows

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("use_prompt"):
            raise UnsupportedError("an MVP model with prompts (use_prompt) is not supported")
        if config.get("share_encoder_decoder_embeddings") is False:
            raise UnsupportedError(
                "a Marian model with separate source and target vocabularies is not supported"
            )
        optional = [
            "activation_function",
            "scale_embedding",
            "max_position_embeddings",
            "model_type",
            "max_encoder_position_embeddings",
            "max_decoder_position_embeddings",
            "attention_window",
        ]
        return args_of(cls, config, optional)


# What a BART-family (or PEGASUS-X) config.json must give.
REQUIRED = (
    "vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "decoder_start_token_id",
)


def args_of(cls: type, config: dict[str, Any], optional: list[str]) -> Any:
    """`cls` (BART's or PEGASUS-X's ModelArgs) of a config.json: REQUIRED's fields, and
    those of `optional` it gives."""
    missing = [name for name in REQUIRED if config.get(name) is None]
    if missing:
        raise ModelFormatError(f"the config.json has no {', '.join(missing)}")
    return cls(
        **{name: config[name] for name in REQUIRED},
        **{name: config[name] for name in optional if config.get(name) is not None},
    )


def check_stacks(args: Any) -> None:
    """Refuse a BART-style ModelArgs (BART's, PEGASUS-X's) whose heads do not divide d_model
    or whose activation is unknown; set its `act` and what llmrun's KV cache (the decoder's
    self-attention) reads."""
    for side in ("encoder", "decoder"):
        if args.d_model % getattr(args, f"{side}_attention_heads"):
            raise ModelFormatError(
                f"d_model {args.d_model} is not a multiple of {side}_attention_heads"
            )
    # transformers' ACT2FN: "swish" is SiLU.
    args.act = "silu" if args.activation_function == "swish" else args.activation_function
    activation(args.act)  # refuses an unknown one
    args.num_hidden_layers = args.decoder_layers
    args.num_key_value_heads = args.decoder_attention_heads
    args.head_dim = args.d_model // args.decoder_attention_heads


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
    zero column after them where dim is odd. Row p + pad_token_id + 1 is position p (rows up
    to the padding_idx one are never read for a text without padding)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, device=positions.device).float() * -step)
    angles = positions[..., None].float() * freqs
    out = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if dim % 2:
        out = torch.cat([out, out.new_zeros(*out.shape[:-1], 1)], dim=-1)
    return out


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, radius: int
) -> torch.Tensor:
    """LED's (Longformer's) local attention without global tokens: token i attends to the
    tokens within `radius` of it, softmax(q k^T / sqrt(head_dim)) v over them; q, k, v
    [1, H, S, head_dim] -> [1, S, H*head_dim]. Queries go in chunks of 2*radius, each
    against its keys only, so memory grows with S, not S^2."""
    length, chunk = q.shape[2], 2 * radius
    out = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        low, high = max(0, start - radius), min(length, end + radius)
        queries = torch.arange(start, end, device=q.device)
        keys = torch.arange(low, high, device=q.device)
        near = (queries[:, None] - keys[None, :]).abs() <= radius
        out.append(
            attention(
                q[:, :, start:end],
                k[:, :, low:high],
                v[:, :, low:high],
                near[None, None],
                q.shape[-1] ** -0.5,
            )
        )
    return torch.cat(out, dim=1)


class Attention(nn.Module):
    """q_proj, k_proj, v_proj, out_proj, biased unless `bias` is False; keys and values of
    features `source` wide (TrOCR's cross-attention), else `dim`; softmax(q k^T /
    sqrt(head_dim)) v."""

    def __init__(self, dim: int, heads: int, source: int | None = None, bias: bool = True) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(source or dim, dim, bias=bias)
        self.v_proj = nn.Linear(source or dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

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
    """An encoder or decoder: its layers, its learned positions, the embeddings' norm and
    the final norm, where the family's layout has them."""

    def __init__(self, args: ModelArgs, layers: int, decoder: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(args, decoder) for _ in range(layers))
        self.positions = args.decoder_positions if decoder else args.encoder_positions
        if not args.sinusoidal:
            rows = self.positions + (POSITION_OFFSET if args.layout.offset else 0)
            self.embed_positions = nn.Embedding(rows, args.d_model)
        if args.embedding_norm:
            self.layernorm_embedding = nn.LayerNorm(args.d_model)
        if args.pre_norm:
            self.layer_norm = nn.LayerNorm(args.d_model)


class Seq2Seq(nn.Module):
    """HF's BartModel (MBartModel, MarianModel, ...): the shared embedding and the two
    stacks."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = Stack(args, args.encoder_layers, decoder=False)
        self.decoder = Stack(args, args.decoder_layers, decoder=True)


# Each decoder layer's cross-attention keys and values, [1, heads, source, head_dim] each.
CrossCache = list[tuple[torch.Tensor, torch.Tensor]]


def cross_keys_values(layers: nn.ModuleList, encoded: torch.Tensor) -> CrossCache:
    """Each decoder layer's cross-attention (its encoder_attn, an Attention) keys and values
    of an encoding; BART's, PEGASUS-X's and TrOCR's decoders alike."""
    out = []
    for layer in layers:
        attn = layer.encoder_attn
        k, v = attn.split(attn.k_proj(encoded)), attn.split(attn.v_proj(encoded))
        out.append((k.contiguous(), v.contiguous()))
    return out


def run_decoder(
    layers: nn.ModuleList,
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache | None,
    cross: CrossCache,
) -> torch.Tensor:
    """`x` [B, T, d_model], the embeddings of tokens at `positions` [B, T] after those
    `cache` holds, through decoder layers (BART's Layer or its like: self_attn and
    encoder_attn Attentions, residual, feed_forward): each layer's causal self-attention
    (no RoPE), its cross-attention to `cross`, then its feed-forward, each through the
    layer's residual."""
    start, length = int(positions[0, 0]), int(positions.max()) + 1
    keys = key_positions(positions, length, cache)
    no_rope = positions.new_zeros(0, dtype=x.dtype)
    frame = Frame(positions, start, length, attention_mask(positions, keys), no_rope, no_rope)
    for index, layer in enumerate(layers):

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
            return attn.out_proj(attention(q, *cross[index], None, attn.head_dim**-0.5))

        x = layer.residual(x, layer.self_attn_layer_norm, attend_own)
        x = layer.residual(x, layer.encoder_attn_layer_norm, attend_source)
        x = layer.residual(x, layer.final_layer_norm, layer.feed_forward)
    return x


class TextToText(nn.Module):
    """What llmrun.text_to_text drives, for BART's, PEGASUS-X's and TrOCR's models: one with
    BART-style decoder layers (model.decoder.layers) and `decode(input_ids, positions, cache,
    cross, last_only)`, the decoder's float32 logits."""

    text_to_text = True  # generated through llmrun.text_to_text, not the batching scheduler

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding."""
        return cross_keys_values(self.model.decoder.layers, encoded)

    def decoding(self, encoded: torch.Tensor) -> Decoding:
        """The decoder, attending to `encoded` (a source's encode())."""
        return Decoding(self, self.cross_cache(encoded))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """The decoder's self-attention cache."""
        return new_cache(self.args, batch, max_seq_len, dtype, device)


class Decoding(nn.Module):
    """A decoder bound to one source's encoding, called as llmrun's language models are:
    logits of ids [B, T] at positions [B, T] after the tokens its KV cache holds."""

    def __init__(self, model: TextToText, cross: CrossCache) -> None:
        super().__init__()
        self.model, self.cross = model, cross

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] ([B, 1, vocab] with last_only)."""
        return self.model.decode(input_ids, positions, cache, self.cross, last_only)


class Model(TextToText):
    """BartForConditionalGeneration's (and its kin's) modules under its names, without its
    generate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Seq2Seq(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, args.vocab_size))
        self.embed_scale = math.sqrt(args.d_model) if args.scale_embedding else 1.0

    def embed(
        self, stack: Stack, input_ids: torch.Tensor, positions: torch.Tensor, images: Any = None
    ) -> torch.Tensor:
        """A stack's input [B, T, d_model]: the scaled token embeddings (`images`' tokens,
        unscaled, in place of their placeholders) plus the positions', normalized where the
        family normalizes them (Blenderbot Small's decoder: its token embeddings normalized,
        unscaled, plus the positions)."""
        last = int(positions.max())
        if last >= stack.positions:
            raise ContextOverflowError(
                f"position {last} is past the model's {stack.positions} positions"
            )
        layout = self.args.layout
        if layout.decoder_norms_tokens and stack is self.model.decoder:
            tokens = stack.layernorm_embedding(self.model.shared(input_ids))
            return tokens + stack.embed_positions(positions)
        x = self.model.shared(input_ids) * self.embed_scale
        if images is not None:
            for start, embeds in zip(images.starts, images.embeds, strict=True):
                x[0, start : start + len(embeds)] = embeds.to(x.dtype)
        if layout.positions == "fairseq":
            # Row p + pad_token_id + 1: POSITION_OFFSET rows on for M2M100's pad of 1.
            rows = positions + POSITION_OFFSET + self.args.pad_token_id - 1
            x = x + fairseq_positions(rows, self.args.d_model).to(x.dtype)
        elif self.args.sinusoidal:
            x = x + sinusoidal_positions(positions, self.args.d_model).to(x.dtype)
        else:
            x = x + stack.embed_positions(positions + (POSITION_OFFSET if layout.offset else 0))
        return stack.layernorm_embedding(x) if self.args.embedding_norm else x

    def encode(self, input_ids: torch.Tensor, images: Any = None) -> torch.Tensor:
        """The encoder's output [1, S, d_model] of a source's ids [1, S]; `images`
        (llmrun.multimodal.PromptImages): each image's tokens in place of its placeholders,
        as transformers scatters Florence-2's image features."""
        stack = self.model.encoder
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed(stack, input_ids, positions, images)
        for index, layer in enumerate(stack.layers):
            window = self.args.windows[index] if self.args.windows else None

            def attend_all(
                h: torch.Tensor, attn: Attention = layer.self_attn, window: int | None = window
            ) -> torch.Tensor:
                q, k, v = (
                    attn.split(attn.q_proj(h)),
                    attn.split(attn.k_proj(h)),
                    attn.split(attn.v_proj(h)),
                )
                if window is None:
                    return attn.out_proj(attention(q, k, v, None, attn.head_dim**-0.5))
                return attn.out_proj(windowed_attention(q, k, v, window // 2))

            x = layer.residual(x, layer.self_attn_layer_norm, attend_all)
            x = layer.residual(x, layer.final_layer_norm, layer.feed_forward)
        return stack.layer_norm(x) if self.args.pre_norm else x

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None,
        cross: CrossCache,
        last_only: bool,
    ) -> torch.Tensor:
        """The decoder's float32 logits [1, T, vocab] ([1, 1, vocab] with last_only) of ids
        [1, T] at positions [1, T], attending to `cross` (cross_cache's)."""
        stack = self.model.decoder
        x = self.embed(stack, input_ids, positions)
        x = run_decoder(stack.layers, x, positions, cache, cross)
        if last_only:
            x = x[:, -1:]
        if self.args.pre_norm:
            x = stack.layer_norm(x)
        return (self.lm_head(x) + self.final_logits_bias).float()
