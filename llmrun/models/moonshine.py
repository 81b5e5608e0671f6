"""Moonshine (MoonshineForConditionalGeneration): speech recognition by an encoder-decoder
over raw 16 kHz audio. The encoder's stem is three 1-D convolutions (127 samples every 64,
tanh and a one-group GroupNorm; then 7 every 3 and 3 every 2, each with GELU: one position
per 384 samples), then pre-LayerNorm layers (no biases in the norms) of bidirectional
attention with RoPE on the first `partial_rotary_factor` of each head's features, in
adjacent pairs, and a GELU MLP; a final LayerNorm. The decoder embeds tokens, then layers of
causal self-attention (the same RoPE; keys and values in a cache), cross-attention to the
encoder's positions (no RoPE; their keys and values computed once per clip) and a gated
SiLU MLP (fc1's second half gates its first); a final LayerNorm and the output head (tied
to the token embedding unless tie_word_embeddings is false).

Reference: transformers/models/moonshine/modeling_moonshine.py (MoonshineEncoder,
MoonshineDecoder, MoonshineAttention, apply_rotary_pos_emb, MoonshineDecoderMLP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import activation, rope_parameters

# The stem's convolutions: (kernel, stride) each.
STEM = ((127, 64), (7, 3), (3, 2))


@dataclass
class ModelArgs:
    """A MoonshineConfig's fields, by its names."""

    vocab_size: int = 32768
    hidden_size: int = 288
    intermediate_size: int = 1152
    encoder_num_hidden_layers: int = 6
    decoder_num_hidden_layers: int = 6
    encoder_num_attention_heads: int = 8
    decoder_num_attention_heads: int = 8
    encoder_num_key_value_heads: int | None = None
    decoder_num_key_value_heads: int | None = None
    encoder_hidden_act: str = "gelu"
    decoder_hidden_act: str = "silu"
    max_position_embeddings: int = 512
    attention_bias: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        heads = {
            self.encoder_num_attention_heads,
            self.decoder_num_attention_heads,
            self.encoder_num_key_value_heads or self.encoder_num_attention_heads,
            self.decoder_num_key_value_heads or self.decoder_num_attention_heads,
        }
        # transformers' MoonshineAttention shapes its queries by the config's last-set
        # key/value heads and its decoder by the encoder's heads: one head count runs.
        if len(heads) != 1:
            raise UnsupportedError(
                f"Moonshine heads {sorted(heads)}: llmrun runs the same number of attention "
                "and key/value heads in the encoder and the decoder"
            )
        if self.hidden_size % self.decoder_num_attention_heads:
            raise ModelFormatError(
                f"hidden_size {self.hidden_size} does not split into "
                f"{self.decoder_num_attention_heads} heads"
            )
        activation(self.encoder_hidden_act)  # refuses an unknown one
        activation(self.decoder_hidden_act)
        if self.rope_parameters.get("rope_type", "default") != "default":
            raise UnsupportedError(f"Moonshine RoPE type {self.rope_parameters['rope_type']!r}")
        if self.head_dim % 2:
            raise UnsupportedError(f"Moonshine's head_dim {self.head_dim} (odd)")

    @property
    def heads(self) -> int:
        return self.decoder_num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions the frequencies are spread over (an odd one turns one more)."""
        return int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = [n for n in cls.__dataclass_fields__ if n != "rope_parameters"]
        values = {n: config[n] for n in names if config.get(n) is not None}
        # MoonshineConfig's default, which older config.json files leave out.
        params = {"partial_rotary_factor": 0.9, **rope_parameters(config)}
        return cls(**values, rope_parameters=params)


class Rotary:
    """RoPE's cos and sin [positions, ceil(rotary_dim / 2)] for positions start..end."""

    def __init__(self, args: ModelArgs, start: int, end: int, device: torch.device):
        dim = args.rotary_dim
        theta = args.rope_parameters.get("rope_theta", 10000.0)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        freqs = torch.arange(start, end, dtype=torch.float)[:, None] * inv_freq
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, heads, t, head_dim] with its first adjacent pairs (x[2i], x[2i+1]) turned,
        one pair per frequency."""
        dim = 2 * self.cos.shape[-1]
        pairs = x[..., :dim].unflatten(-1, (-1, 2))  # [..., dim / 2, 2]
        even, odd = pairs[..., 0], pairs[..., 1]
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
        return torch.cat((turned.flatten(-2), x[..., dim:]), dim=-1)


class Attention(nn.Module):
    """Moonshine's attention: biases on q, k, v where attention_bias says, none on out."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        width, bias = args.hidden_size, args.attention_bias
        self.heads = args.heads
        self.q_proj = nn.Linear(width, width, bias=bias)
        self.k_proj = nn.Linear(width, width, bias=bias)
        self.v_proj = nn.Linear(width, width, bias=bias)
        self.o_proj = nn.Linear(width, width, bias=False)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[b, t, width] -> [b, heads, t, head_dim]."""
        b, t, width = x.shape
        return x.view(b, t, self.heads, width // self.heads).transpose(1, 2)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        return self.split(self.q_proj(x))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k_proj(x)), self.split(self.v_proj(x))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None
    ) -> torch.Tensor:
        """q [b, heads, t, head_dim] attending to k, v [b, heads, s, head_dim];
        `causal_from`: the position of q's first row among k's, None: all of k."""
        b, _, t, _ = q.shape
        mask = None
        if causal_from is not None and t > 1:
            rows = torch.arange(t, device=q.device)[:, None] + causal_from
            mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class EncoderMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.encoder_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, 2 * args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.decoder_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.act(gate) * h)


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = EncoderMLP(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        h = self.input_layernorm(x)
        k, v = self.self_attn.keys_values(h)
        x = x + self.self_attn(rotary(self.self_attn.queries(h)), rotary(k), v, None)
        return x + self.mlp(self.post_attention_layernorm(x))


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        width = args.hidden_size
        (k1, s1), (k2, s2), (k3, s3) = STEM
        self.conv1 = nn.Conv1d(1, width, kernel_size=k1, stride=s1, bias=False)
        self.conv2 = nn.Conv1d(width, 2 * width, kernel_size=k2, stride=s2)
        self.conv3 = nn.Conv1d(2 * width, width, kernel_size=k3, stride=s3)
        self.groupnorm = nn.GroupNorm(num_groups=1, num_channels=width, eps=1e-5)
        self.layers = nn.ModuleList(
            EncoderLayer(args) for _ in range(args.encoder_num_hidden_layers)
        )
        self.layer_norm = nn.LayerNorm(width, bias=False)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        """[b, samples] -> [b, positions, width]."""
        x = self.groupnorm(torch.tanh(self.conv1(samples[:, None])))
        x = F.gelu(self.conv3(F.gelu(self.conv2(x)))).transpose(1, 2)
        rotary = Rotary(self.args, 0, x.shape[1], x.device)
        for layer in self.layers:
            x = layer(x, rotary)
        return self.layer_norm(x)


class SelfCache:
    """The decoder's self-attention keys (turned) and values, [b, heads, positions,
    head_dim] per layer, preallocated."""

    def __init__(self, layers: int, shape: tuple[int, ...], device: torch.device, dtype):
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, heads, t, head_dim] at positions start.. and return all so far."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def reorder_rows(self, rows: torch.Tensor) -> None:
        """Row i takes what row rows[i] held (beam search: each beam goes on from one of
        the last step's)."""
        for cache in (*self.k, *self.v):
            cache.copy_(cache.index_select(0, rows))


# Each decoder layer's cross-attention keys and values, [b, heads, positions, head_dim].
CrossCache = list[tuple[torch.Tensor, torch.Tensor]]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.hidden_size
        self.self_attn = Attention(args)
        self.encoder_attn = Attention(args)
        self.mlp = DecoderMLP(args)
        self.input_layernorm = nn.LayerNorm(width, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(width, bias=False)
        self.final_layernorm = nn.LayerNorm(width, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cache: SelfCache,
        index: int,
        start: int,
        cross: CrossCache,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        k, v = self.self_attn.keys_values(h)
        k, v = cache.update(index, rotary(k), v, start)
        x = x + self.self_attn(rotary(self.self_attn.queries(h)), k, v, causal_from=start)
        h = self.post_attention_layernorm(x)
        x = x + self.encoder_attn(self.encoder_attn.queries(h), *cross[index], None)
        return x + self.mlp(self.final_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(args) for _ in range(args.decoder_num_hidden_layers)
        )
        self.norm = nn.LayerNorm(args.hidden_size, bias=False)


class Moonshine(nn.Module):
    """HF's MoonshineModel: `encoder` and `decoder`, under its names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.encoder = Encoder(args)
        self.decoder = Decoder(args)


def positions(samples: int) -> int:
    """The encoder positions of a clip of `samples` (0: too short for the stem)."""
    for kernel, stride in STEM:
        samples = max(0, (samples - kernel) // stride + 1)
    return samples


class Model(nn.Module):
    """MoonshineForConditionalGeneration without its generate: `encode` a clip's samples,
    `cross_cache` its encoding once, then `decode` ids step by step."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.moonshine decodes it
    transcribes = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Moonshine(args)
        self.proj_out = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def encode(self, samples: torch.Tensor) -> torch.Tensor:
        """A clip's samples [b, samples] -> the encoder's positions [b, positions, width]."""
        if positions(samples.shape[-1]) < 1:
            raise ValueError(f"{samples.shape[-1]} samples: too short for Moonshine's stem")
        return self.model.encoder(samples)

    def cross_cache(self, encoded: torch.Tensor) -> CrossCache:
        """Each decoder layer's cross-attention keys and values of an encoding."""
        return [layer.encoder_attn.keys_values(encoded) for layer in self.model.decoder.layers]

    def new_cache(self, batch: int = 1) -> SelfCache:
        """A cache of all the decoder's positions for `batch` sequences."""
        args, norm = self.args, self.model.decoder.norm.weight
        shape = (batch, args.heads, args.max_position_embeddings, args.head_dim)
        return SelfCache(args.decoder_num_hidden_layers, shape, norm.device, norm.dtype)

    def decode(
        self, ids: torch.Tensor, cache: SelfCache, start: int, cross: CrossCache
    ) -> torch.Tensor:
        """Logits [b, t, vocab] of ids [b, t] at positions start.. (the cache holds the ids
        before them)."""
        decoder = self.model.decoder
        end = start + ids.shape[1]
        if end > self.args.max_position_embeddings:
            raise ValueError(
                f"decoder positions up to {end}, over {self.args.max_position_embeddings}"
            )
        rotary = Rotary(self.args, start, end, ids.device)
        x = decoder.embed_tokens(ids)
        for index, layer in enumerate(decoder.layers):
            x = layer(x, rotary, cache, index, start, cross)
        return self.proj_out(decoder.norm(x))
