"""SeamlessM4T v2 (SeamlessM4Tv2Model: facebook/seamless-m4t-v2-large) as a speech or text
translator to text: a w2v-BERT 2.0 speech encoder or an NLLB text encoder, and an NLLB text
decoder. Its text stacks are M2M100's (llmrun.models.bart, the "m2m_100"
layout: pre-norm layers, relu, embeddings scaled by sqrt(hidden_size), fairseq sinusoidal
positions numbered from pad_token_id + 1); the loader gives their tensors BART's names.

The speech encoder takes the feature extractor's stacked filterbank frames [1, T, 160] of which
the first `valid` are real (an odd frame count leaves a last half-padded frame that its
attention mask hides): a LayerNorm and a projection; Conformer layers (a half-step feed-forward,
self-attention with learned relative-distance key embeddings clamped to
[-left_max_position_embeddings, right_max_position_embeddings] and chunked as
speech_encoder_chunk_size says, a convolution module with a causal depthwise convolution, a
second half-step feed-forward, a LayerNorm), keys beyond `valid` masked and those frames zeroed
where transformers zeroes them; a LayerNorm; a half-step relu feed-forward; the length adaptor
(each layer: a strided convolution + GLU on the residual and on self-attention's input, whose
keys beyond the subsampled valid length are masked, then a relu feed-forward); a LayerNorm. The
decoder attends to the adaptor's valid positions alone, as its cross-attention mask has it.

SeamlessM4T v1 (SeamlessM4TModel: facebook/hf-seamless-m4t-medium, -large; model_type
seamless_m4t) differs in its Conformer alone: Transformer-XL relative positions (sinusoids of
the query - key distance through linear_pos, pos_bias_u and pos_bias_v), no chunks, and a
centered depthwise convolution followed by a BatchNorm.

Speech output (the text-to-unit model and the vocoder) is not run.

Reference: transformers/models/seamless_m4t_v2/modeling_seamless_m4t_v2.py
(SeamlessM4Tv2SpeechEncoder, SeamlessM4Tv2ConformerEncoder, SeamlessM4Tv2ConformerSelfAttention
with eager_attention_forward's position_bias, SeamlessM4Tv2ConformerConvolutionModule,
SeamlessM4Tv2ConformerAdapterLayer, _compute_sub_sample_lengths_from_attention_mask),
models/seamless_m4t/modeling_seamless_m4t.py (SeamlessM4TConformerRelPositionalEmbedding,
_apply_relative_position_encoding, SeamlessM4TConformerConvolutionModule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import bart
from llmrun.models.base import activation

MODEL_TYPE = "seamless_m4t_v2"
V1 = "seamless_m4t"
# Each version's speech encoder attention: v2's learned relative-distance keys, v1's
# Transformer-XL relative sinusoids.
POSITIONS = {MODEL_TYPE: "relative_key", V1: "relative"}


@dataclass
class ModelArgs:
    """A SeamlessM4Tv2Config's fields that text generation reads, by its names."""

    vocab_size: int = 256102
    hidden_size: int = 1024
    encoder_layers: int = 24
    decoder_layers: int = 24
    encoder_ffn_dim: int = 8192
    decoder_ffn_dim: int = 8192
    encoder_attention_heads: int = 16
    decoder_attention_heads: int = 16
    decoder_start_token_id: int = 3
    pad_token_id: int = 0
    max_position_embeddings: int = 4096
    scale_embedding: bool = True
    activation_function: str = "relu"
    layer_norm_eps: float = 1e-5
    speech_encoder_layers: int = 24
    speech_encoder_attention_heads: int = 16
    speech_encoder_intermediate_size: int = 4096
    speech_encoder_hidden_act: str = "swish"
    feature_projection_input_dim: int = 160
    add_adapter: bool = True
    adaptor_kernel_size: int = 8
    adaptor_stride: int = 8
    num_adapter_layers: int = 1
    position_embeddings_type: str = "relative_key"
    conv_depthwise_kernel_size: int = 31
    left_max_position_embeddings: int = 64
    right_max_position_embeddings: int = 8
    speech_encoder_chunk_size: int | None = 20000
    speech_encoder_left_chunk_num: int = 128
    model_type: str = MODEL_TYPE

    def __post_init__(self) -> None:
        if self.model_type not in POSITIONS:
            raise UnsupportedError(f"model_type {self.model_type!r} is not a SeamlessM4T")
        if self.model_type == V1:
            self.speech_encoder_chunk_size = None  # v1 attends to the whole clip
            if self.position_embeddings_type == "relative_key":  # v2's default, not v1's
                self.position_embeddings_type = "relative"
        wanted = POSITIONS[self.model_type]
        if self.position_embeddings_type != wanted:
            raise UnsupportedError(
                f"position_embeddings_type {self.position_embeddings_type!r}: llmrun runs "
                f"{self.model_type}'s {wanted}"
            )
        if self.hidden_size % self.speech_encoder_attention_heads:
            raise ModelFormatError(
                f"hidden_size {self.hidden_size} does not split into "
                f"{self.speech_encoder_attention_heads} speech encoder heads"
            )
        if self.conv_depthwise_kernel_size % 2 == 0 or self.adaptor_stride < 1:
            raise ModelFormatError(
                f"conv_depthwise_kernel_size {self.conv_depthwise_kernel_size}, adaptor_stride "
                f"{self.adaptor_stride}"
            )
        act = self.speech_encoder_hidden_act
        self.speech_act = "silu" if act == "swish" else act  # transformers' ACT2FN
        activation(self.speech_act)  # refuses an unknown one
        self.text = bart.ModelArgs(
            vocab_size=self.vocab_size,
            d_model=self.hidden_size,
            encoder_layers=self.encoder_layers,
            decoder_layers=self.decoder_layers,
            encoder_attention_heads=self.encoder_attention_heads,
            decoder_attention_heads=self.decoder_attention_heads,
            encoder_ffn_dim=self.encoder_ffn_dim,
            decoder_ffn_dim=self.decoder_ffn_dim,
            decoder_start_token_id=self.decoder_start_token_id,
            activation_function=self.activation_function,
            scale_embedding=self.scale_embedding,
            max_position_embeddings=self.max_position_embeddings,
            model_type="m2m_100",
            pad_token_id=self.pad_token_id,
        )
        # What llmrun's KV cache sizing reads: the text decoder's self-attention.
        self.num_hidden_layers = self.text.num_hidden_layers
        self.num_key_value_heads = self.text.num_key_value_heads
        self.head_dim = self.text.head_dim

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = [f.name for f in fields(cls)]
        return cls(**{n: config[n] for n in names if config.get(n) is not None})

    def encoded_length(self, valid: int) -> int:
        """The positions the decoder attends to of `valid` stacked frames: the adaptor's
        subsampled length (transformers' _compute_sub_sample_lengths_from_attention_mask)."""
        if not self.add_adapter:
            return valid
        k = self.adaptor_kernel_size
        return (valid + 2 * (k // 2) - k) // self.adaptor_stride + 1


class FeedForward(nn.Module):
    """intermediate_dense, the activation, output_dense."""

    def __init__(self, args: ModelArgs, act: str) -> None:
        super().__init__()
        self.intermediate_dense = nn.Linear(args.hidden_size, args.speech_encoder_intermediate_size)
        self.output_dense = nn.Linear(args.speech_encoder_intermediate_size, args.hidden_size)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(self.act(self.intermediate_dense(x)))


def relative_sinusoids(length: int, dim: int, device: torch.device) -> torch.Tensor:
    """v1's relative position vectors [2 * length - 1, dim] of query - key distances
    length - 1 down to -(length - 1): sin and cos (interleaved) of the distance times
    10000**(-2i/dim), in float32 as SeamlessM4TConformerRelPositionalEmbedding's table."""
    distances = torch.arange(length - 1, -length, -1, device=device).float()
    freqs = torch.exp(torch.arange(0, dim, 2, device=device).float() * -(math.log(10000.0) / dim))
    angles = distances[:, None] * freqs[None, :]
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(len(distances), dim)


class SelfAttention(nn.Module):
    """linear_q, linear_k, linear_v, linear_out; with `relative` "relative_key" (v2), a
    learned embedding per clamped key - query distance whose product with the query is added
    to the scores; with "relative" (v1, Transformer-XL's), the projected sinusoids of the
    query - key distance times the query plus pos_bias_v, and pos_bias_u added to the
    query."""

    def __init__(self, args: ModelArgs, relative: str | None) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.speech_encoder_attention_heads
        self.head_dim = dim // self.heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.left = args.left_max_position_embeddings
        self.right = args.right_max_position_embeddings
        if relative == "relative_key":
            self.distance_embedding = nn.Embedding(self.left + self.right + 1, self.head_dim)
        elif relative == "relative":
            self.linear_pos = nn.Linear(dim, dim, bias=False)
            self.pos_bias_u = nn.Parameter(torch.zeros(self.heads, self.head_dim))
            self.pos_bias_v = nn.Parameter(torch.zeros(self.heads, self.head_dim))
        self.relative = relative

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [1, T, dim]; mask [T, T] (True: attend)."""
        b, t, _ = x.shape

        def split(h: torch.Tensor) -> torch.Tensor:
            return h.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.linear_q(x)), split(self.linear_k(x)), split(self.linear_v(x))
        scale = self.head_dim**-0.5
        at = torch.arange(t, device=x.device)
        if self.relative == "relative":
            table = relative_sinusoids(t, self.heads * self.head_dim, x.device).to(q.dtype)
            # [2T - 1, dim] -> [heads, head_dim, 2T - 1]; column T - 1 - (i - j) is i's to j.
            table = self.linear_pos(table).view(-1, self.heads, self.head_dim).permute(1, 2, 0)
            by_distance = (q + self.pos_bias_v[None, :, None]) @ table
            column = (t - 1 - at[:, None] + at[None, :]).expand(b, self.heads, t, t)
            position_scores = by_distance.gather(-1, column) * scale
            q = q + self.pos_bias_u[None, :, None]
        scores = (q @ k.transpose(-1, -2)) * scale
        if self.relative == "relative":
            scores = scores + position_scores
        elif self.relative == "relative_key":
            # Each query's products with the distances' embeddings [B, H, T, left + right + 1],
            # then the one of each key's clamped distance (not a [T, T, head_dim] table).
            every = torch.arange(self.left + self.right + 1, device=x.device)
            by_distance = q @ self.distance_embedding(every).to(q.dtype).T
            distance = (at[None, :] - at[:, None]).clamp(-self.left, self.right) + self.left
            position_scores = by_distance.gather(-1, distance.expand(b, self.heads, t, t))
            scores = scores + position_scores / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.linear_out(out.transpose(1, 2).reshape(b, t, -1))


class ConvolutionModule(nn.Module):
    """LayerNorm, pointwise conv + GLU, depthwise conv (v2's causal, then a LayerNorm; v1's
    centered, then a BatchNorm), activation, pointwise conv; frames at and after `valid`
    zeroed before the convolutions."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, kernel = args.hidden_size, args.conv_depthwise_kernel_size
        self.layer_norm = nn.LayerNorm(dim)
        self.pointwise_conv1 = nn.Conv1d(dim, 2 * dim, 1, bias=False)
        self.depthwise_conv = nn.Conv1d(dim, dim, kernel, groups=dim, bias=False)
        self.causal = args.model_type == MODEL_TYPE
        if self.causal:
            self.depthwise_layer_norm = nn.LayerNorm(dim)
        else:
            self.batch_norm = nn.BatchNorm1d(dim)
        self.pointwise_conv2 = nn.Conv1d(dim, dim, 1, bias=False)
        self.act = activation(args.speech_act)

    def forward(self, x: torch.Tensor, valid: int) -> torch.Tensor:
        x = self.layer_norm(x)
        x[:, valid:] = 0.0
        x = F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)
        k = self.depthwise_conv.kernel_size[0]
        if self.causal:
            x = self.depthwise_conv(F.pad(x, (k - 1, 0)))
            x = self.depthwise_layer_norm(x.transpose(1, 2)).transpose(1, 2)
        else:
            x = self.batch_norm(self.depthwise_conv(F.pad(x, ((k - 1) // 2, (k - 1) // 2))))
        return self.pointwise_conv2(self.act(x)).transpose(1, 2)


class ConformerLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.ffn1_layer_norm = nn.LayerNorm(dim)
        self.ffn1 = FeedForward(args, args.speech_act)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = SelfAttention(args, relative=args.position_embeddings_type)
        self.conv_module = ConvolutionModule(args)
        self.ffn2_layer_norm = nn.LayerNorm(dim)
        self.ffn2 = FeedForward(args, args.speech_act)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, valid: int) -> torch.Tensor:
        x = x + 0.5 * self.ffn1(self.ffn1_layer_norm(x))
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        x = x + self.conv_module(x, valid)
        x = x + 0.5 * self.ffn2(self.ffn2_layer_norm(x))
        return self.final_layer_norm(x)


class AdapterLayer(nn.Module):
    """The length adaptor's layer: its strided convolutions pool the residual and the
    self-attention's input alike."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, k, s = args.hidden_size, args.adaptor_kernel_size, args.adaptor_stride
        self.residual_layer_norm = nn.LayerNorm(dim)
        self.residual_conv = nn.Conv1d(dim, 2 * dim, k, stride=s, padding=s // 2)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn_conv = nn.Conv1d(dim, 2 * dim, k, stride=s, padding=s // 2)
        self.self_attn = SelfAttention(args, relative=None)
        self.ffn_layer_norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(args, "relu")

    def forward(self, x: torch.Tensor, keys: int) -> torch.Tensor:
        """x [1, T, dim] -> [1, T', dim], attending to the first `keys` pooled positions."""
        residual = F.glu(self.residual_conv(self.residual_layer_norm(x).transpose(1, 2)), dim=1)
        h = F.glu(self.self_attn_conv(self.self_attn_layer_norm(x).transpose(1, 2)), dim=1)
        h, residual = h.transpose(1, 2), residual.transpose(1, 2)
        mask = (torch.arange(h.shape[1], device=x.device) < keys)[None, :]
        x = self.self_attn(h, mask) + residual
        return x + self.ffn(self.ffn_layer_norm(x))


class FeatureProjection(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(args.feature_projection_input_dim, eps=args.layer_norm_eps)
        self.projection = nn.Linear(args.feature_projection_input_dim, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.layer_norm(x))


class ConformerEncoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ConformerLayer(args) for _ in range(args.speech_encoder_layers))
        self.layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)


class Adapter(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AdapterLayer(args) for _ in range(args.num_adapter_layers))


class SpeechEncoder(nn.Module):
    """SeamlessM4Tv2SpeechEncoder under its names."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.feature_projection = FeatureProjection(args)
        self.encoder = ConformerEncoder(args)
        self.intermediate_ffn = FeedForward(args, "relu")
        if args.add_adapter:
            self.adapter = Adapter(args)
        self.inner_layer_norm = nn.LayerNorm(args.hidden_size)

    def attention_mask(self, length: int, valid: int, device: torch.device) -> torch.Tensor:
        """[T, T]: keys before `valid`, within the query's chunk or the left chunks it sees."""
        args = self.args
        at = torch.arange(length, device=device)
        mask = (at < valid)[None, :].expand(length, length)
        size = args.speech_encoder_chunk_size
        if size is not None:
            chunk = at // size
            start = torch.zeros_like(chunk)
            if args.speech_encoder_left_chunk_num >= 0:
                start = (chunk - args.speech_encoder_left_chunk_num).clamp(min=0) * size
            end = ((chunk + 1) * size).clamp(max=length)
            mask = mask & (at[None, :] >= start[:, None]) & (at[None, :] < end[:, None])
        return mask

    def forward(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        """Stacked frames [1, T, feature_projection_input_dim], the first `valid` real ->
        the positions the decoder attends to [1, encoded_length(valid), hidden_size]."""
        args = self.args
        x = self.feature_projection(features)
        x[:, valid:] = 0.0
        mask = self.attention_mask(x.shape[1], valid, x.device)
        for layer in self.encoder.layers:
            x = layer(x, mask, valid)
        x = self.encoder.layer_norm(x)
        x = x + 0.5 * self.intermediate_ffn(x)
        keys = args.encoded_length(valid)
        if args.add_adapter:
            for layer in self.adapter.layers:
                x = layer(x, keys)
        return self.inner_layer_norm(x[:, :keys])


class Model(bart.Model):
    """SeamlessM4Tv2Model's speech encoder, text encoder and text decoder (the text stacks
    as llmrun.models.bart's M2M100 names them), without its speech output; `encode` takes
    a text's ids (llmrun.text_to_text), `encode_speech` a clip's stacked frames
    (llmrun.seamless_m4t)."""

    transcribes = True
    text_to_text = True

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args.text)
        self.speech_args = args
        self.speech_encoder = SpeechEncoder(args)

    def encode_speech(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        """A clip's stacked frames [1, T, 160], the first `valid` real -> the decoder's
        source [1, positions, hidden_size]."""
        return self.speech_encoder(features, valid)
