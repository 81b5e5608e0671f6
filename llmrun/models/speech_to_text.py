"""Speech2Text (Speech2TextForConditionalGeneration: facebook/s2t-*): speech recognition by
an encoder-decoder over log-mel filterbank frames. A subsampler of 1-D convolutions (stride
2, each halved by a GLU) takes the frames to one position per 2^layers; the encoder scales
them by sqrt(d_model), adds fairseq's sinusoidal positions and runs pre-LayerNorm layers
of bidirectional attention and an MLP, then a final LayerNorm. The decoder embeds tokens
(scaled the same way) plus those positions, then pre-LayerNorm layers of causal
self-attention (keys and values in a cache), cross-attention to the encoder's positions
(their keys and values computed once per clip) and an MLP; a final LayerNorm and the output
head (tied to the token embedding unless tie_word_embeddings is false). The positions'
rows start after pad_token_id, as fairseq's make_positions numbers them.

Reference: transformers/models/speech_to_text/modeling_speech_to_text.py (Conv1dSubsampler,
Speech2TextSinusoidalPositionalEmbedding, Speech2TextEncoder, Speech2TextDecoder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import whisper
from llmrun.models.base import activation
from llmrun.models.cohere_asr import CrossCache, SelfCache


@dataclass
class ModelArgs:
    """A Speech2TextConfig's fields, by its names."""

    vocab_size: int = 10000
    d_model: int = 256
    encoder_layers: int = 12
    encoder_ffn_dim: int = 2048
    encoder_attention_heads: int = 4
    decoder_layers: int = 6
    decoder_ffn_dim: int = 2048
    decoder_attention_heads: int = 4
    activation_function: str = "relu"
    scale_embedding: bool = True
    pad_token_id: int = 1
    max_source_positions: int = 6000
    max_target_positions: int = 1024
    num_conv_layers: int = 2
    conv_kernel_sizes: tuple[int, ...] = (5, 5)
    conv_channels: int = 1024
    input_feat_per_channel: int = 80
    input_channels: int = 1

    def __post_init__(self) -> None:
        self.conv_kernel_sizes = tuple(self.conv_kernel_sizes)
        for heads in (self.encoder_attention_heads, self.decoder_attention_heads):
            if self.d_model % heads:
                raise ModelFormatError(f"d_model {self.d_model} does not split into {heads} heads")
        if len(self.conv_kernel_sizes) != self.num_conv_layers:
            raise ModelFormatError(
                f"{self.num_conv_layers} conv layers and conv_kernel_sizes {self.conv_kernel_sizes}"
            )
        if self.conv_channels % 2 or self.input_channels != 1:
            raise UnsupportedError(
                f"conv_channels {self.conv_channels}, input_channels {self.input_channels} "
                "(llmrun runs an even channel count over one input channel)"
            )
        activation(self.activation_function)  # refuses an unknown one
        # What llmrun.seq2seq reads.
        self.max_position_embeddings = self.max_target_positions

    @property
    def mel_bins(self) -> int:
        return self.input_feat_per_channel * self.input_channels

    @classmethod
    def from_config(cls, config: dict) -> ModelArgs:
        names = list(cls.__dataclass_fields__)
        return cls(**{n: config[n] for n in names if config.get(n) is not None})


def positions(start: int, end: int, args: ModelArgs, device: torch.device) -> torch.Tensor:
    """The position vectors [end - start, d_model] of positions start.. (float32), as the
    table of Speech2TextSinusoidalPositionalEmbedding holds them: row p + pad_token_id + 1,
    the sines of row * 10000**(-i / (d_model/2 - 1)) then their cosines (a zero column
    after where d_model is odd)."""
    half = args.d_model // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, device=device).float() * -step)
    rows = torch.arange(start, end, device=device) + args.pad_token_id + 1
    angles = rows.float()[:, None] * freqs[None, :]
    out = torch.cat([angles.sin(), angles.cos()], dim=1)
    return F.pad(out, (0, args.d_model % 2))


class Subsampler(nn.Module):
    """The frames [b, frames, mel] -> [b, positions, d_model]: each convolution (stride 2,
    padded k // 2) doubles the channels a GLU then halves."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        count = args.num_conv_layers
        self.conv_layers = nn.ModuleList(
            nn.Conv1d(
                args.mel_bins if i == 0 else args.conv_channels // 2,
                args.conv_channels if i < count - 1 else 2 * args.d_model,
                kernel_size=k,
                stride=2,
                padding=k // 2,
            )
            for i, k in enumerate(args.conv_kernel_sizes)
        )

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.transpose(1, 2)
        for conv in self.conv_layers:
            x = F.glu(conv(x), dim=1)
        return x.transpose(1, 2)

    def positions(self, frames: int) -> int:
        """The positions `frames` frames subsample to."""
        for conv in self.conv_layers:
            k = conv.kernel_size[0]
            frames = (frames + 2 * (k // 2) - k) // 2 + 1
        return frames


class Attention(whisper.Attention):
    """Whisper's attention with a bias on k too, scaled by head_dim**-0.5 inside the
    product."""

    key_bias = True
    queries_scaled_first = False


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.d_model
        self.self_attn = Attention(width, args.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, args.encoder_ffn_dim)
        self.fc2 = nn.Linear(args.encoder_ffn_dim, width)
        self.final_layer_norm = nn.LayerNorm(width)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn(h, *self.self_attn.keys_values(h), None)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class DecoderLayer(whisper.DecoderLayer):
    """Whisper's decoder layer (self-attention, cross-attention, MLP, each pre-LayerNorm)
    with Speech2Text's attention."""

    attention_class = Attention


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.conv = Subsampler(args)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.encoder_layers))
        self.layer_norm = nn.LayerNorm(args.d_model)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.decoder_layers))
        self.layer_norm = nn.LayerNorm(args.d_model)


class Speech2Text(nn.Module):
    """HF's Speech2TextModel: `encoder` and `decoder`, under its names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.encoder = Encoder(args)
        self.decoder = Decoder(args)


class Model(nn.Module):
    """Speech2TextForConditionalGeneration without its generate: `encode` a clip's frames,
    `cross_cache` its encoding once, then `decode` ids step by step."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.speech_to_text
    transcribes = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Speech2Text(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.scale = math.sqrt(args.d_model) if args.scale_embedding else 1.0

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """A clip's features [b, frames, mel] -> the encoder's positions [b, positions,
        d_model]."""
        encoder, args = self.model.encoder, self.args
        if features.shape[-1] != args.mel_bins:
            raise ValueError(f"Speech2Text features of shape {list(features.shape)}")
        x = encoder.conv(features) * self.scale
        if x.shape[1] > args.max_source_positions:
            raise ValueError(f"{x.shape[1]} positions, over {args.max_source_positions}")
        if args.pad_token_id != 0:  # else every frame numbers as padding: the zero row
            x = x + positions(0, x.shape[1], args, x.device).to(x.dtype)
        for layer in encoder.layers:
            x = layer(x)
        return encoder.layer_norm(x)

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding."""
        return [layer.encoder_attn.keys_values(encoded) for layer in self.model.decoder.layers]

    def new_cache(self, batch: int = 1) -> SelfCache:
        """A cache of all the decoder's positions for `batch` sequences."""
        args, norm = self.args, self.model.decoder.layer_norm.weight
        heads = args.decoder_attention_heads
        shape = (batch, heads, args.max_target_positions, args.d_model // heads)
        return SelfCache(args.decoder_layers, shape, norm.device, norm.dtype)

    def decode(
        self, ids: torch.Tensor, cache: SelfCache, start: int, cross: CrossCache
    ) -> torch.Tensor:
        """Logits [b, t, vocab] of ids [b, t] at positions start.. (the cache holds the ids
        before them)."""
        decoder = self.model.decoder
        end = start + ids.shape[1]
        if end > self.args.max_target_positions:
            raise ValueError(
                f"decoder positions up to {end}, over {self.args.max_target_positions}"
            )
        x = decoder.embed_tokens(ids) * self.scale
        x = x + positions(start, end, self.args, ids.device).to(x.dtype)
        for index, layer in enumerate(decoder.layers):
            x = layer(x, cache, index, start, cross)
        return self.lm_head(decoder.layer_norm(x))
