"""wav2vec 2.0 speech recognition by CTC (Wav2Vec2ForCTC: facebook/wav2vec2-base-960h, the
large and XLSR fine-tunes) and its kin: normalized 16 kHz samples -> a stack of strided 1-D
convolutions (the first group-normalized, "group"; or each layer-normalized, "layer") ->
a LayerNorm and a projection -> a grouped convolution's relative positions (a weight-normed
kernel, its last output dropped when its width is even, GELU) added -> Transformer layers,
post-LayerNorm (base) or pre-LayerNorm with a final LayerNorm (do_stable_layer_norm: large,
XLSR) -> a linear head to the characters. One clip at a time, unpadded.

The kin, each under its own prefix: HubertForCTC (`hubert.`: feat_proj_layer_norm may leave
out the projection's LayerNorm); Data2VecAudioForCTC (`data2vec_audio.`: layer-normalized
convolutions, post-LayerNorm layers, and for positions a stack of num_conv_pos_embeddings
plain convolutions, each followed by a LayerNorm without weights); WavLMForCTC (`wavlm.`:
attention scores plus a relative position bias in T5's log buckets, learned by the first
layer and reused by the rest, gated per head and query by the attention's input).

The positional convolution's weight is its weight-norm product (g * v / |v|, the norm over
all but the kernel axis), which llmrun.loading.wav2vec2 computes once at load.

Reference: transformers/models/wav2vec2/modeling_wav2vec2.py (Wav2Vec2FeatureEncoder,
Wav2Vec2PositionalConvEmbedding, Wav2Vec2Encoder, Wav2Vec2EncoderStableLayerNorm,
Wav2Vec2ForCTC), transformers/models/hubert/modeling_hubert.py (HubertFeatureProjection,
HubertForCTC), data2vec/modeling_data2vec_audio.py (Data2VecAudioPositionalConvEmbedding),
wavlm/modeling_wavlm.py (WavLMAttention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import activation

DATA2VEC = "data2vec-audio"
# config.json's model_type -> the name of the model under the CTC head
PREFIXES = {
    "wav2vec2": "wav2vec2",
    "hubert": "hubert",
    DATA2VEC: "data2vec_audio",
    "wavlm": "wavlm",
}


@dataclass
class ModelArgs:
    model_type: str = "wav2vec2"
    vocab_size: int = 32
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    feat_extract_norm: str = "group"
    feat_extract_activation: str = "gelu"
    conv_dim: list[int] = field(default_factory=lambda: [512] * 7)
    conv_stride: list[int] = field(default_factory=lambda: [5, 2, 2, 2, 2, 2, 2])
    conv_kernel: list[int] = field(default_factory=lambda: [10, 3, 3, 3, 3, 2, 2])
    conv_bias: bool = False
    num_conv_pos_embeddings: int = 128
    num_conv_pos_embedding_groups: int = 16
    do_stable_layer_norm: bool = False
    pad_token_id: int = 0  # the CTC blank
    add_adapter: bool = False
    adapter_attn_dim: int | None = None
    feat_proj_layer_norm: bool = True  # HuBERT's; wav2vec2 always has it
    conv_pos_batch_norm: bool = False  # HuBERT's
    conv_pos_kernel_size: int = 19  # data2vec-audio's (its num_conv_pos_embeddings: layers)
    num_buckets: int = 320  # WavLM's relative positions
    max_bucket_distance: int = 800

    def __post_init__(self) -> None:
        if self.model_type not in PREFIXES:
            raise UnsupportedError(f"model_type {self.model_type!r} is not a wav2vec2 CTC model's")
        if self.model_type != "hubert":
            self.feat_proj_layer_norm = True
        if self.model_type == DATA2VEC:
            self.feat_extract_norm, self.do_stable_layer_norm = "layer", False
        if self.conv_pos_batch_norm:
            raise UnsupportedError("conv_pos_batch_norm (a batch-normed positional convolution)")
        if self.feat_extract_norm not in ("group", "layer"):
            raise UnsupportedError(f"feat_extract_norm {self.feat_extract_norm!r}")
        if not len(self.conv_dim) == len(self.conv_stride) == len(self.conv_kernel) > 0:
            raise ModelFormatError(
                f"conv_dim, conv_stride and conv_kernel of {len(self.conv_dim)}, "
                f"{len(self.conv_stride)} and {len(self.conv_kernel)} layers"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"hidden_size {self.hidden_size} is not {self.num_attention_heads} heads"
            )
        if self.add_adapter or self.adapter_attn_dim is not None:
            raise UnsupportedError("wav2vec2 adapters (add_adapter, adapter_attn_dim)")
        activation(self.hidden_act)  # refuse an unknown one
        activation(self.feat_extract_activation)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    def frames(self, samples: int) -> int:
        """The positions `samples` samples convolve to."""
        for kernel, stride in zip(self.conv_kernel, self.conv_stride, strict=True):
            samples = (samples - kernel) // stride + 1
        return samples


class ConvLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        width = args.conv_dim[index]
        before = args.conv_dim[index - 1] if index else 1
        kernel, stride = args.conv_kernel[index], args.conv_stride[index]
        self.conv = nn.Conv1d(before, width, kernel, stride=stride, bias=args.conv_bias)
        self.kind = None
        if args.feat_extract_norm == "layer":
            self.kind, self.layer_norm = "layer", nn.LayerNorm(width)
        elif index == 0:
            self.kind, self.layer_norm = "group", nn.GroupNorm(width, width)
        self.activation = activation(args.feat_extract_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)  # [1, C, T]
        if self.kind == "layer":
            x = self.layer_norm(x.transpose(1, 2)).transpose(1, 2)
        elif self.kind == "group":
            x = self.layer_norm(x)
        return self.activation(x)


class FeatureEncoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.conv_layers = nn.ModuleList(ConvLayer(args, i) for i in range(len(args.conv_dim)))

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        x = samples[None, None]  # [1, 1, samples]
        for layer in self.conv_layers:
            x = layer(x)
        return x[0].T  # [frames, C]


class FeatureProjection(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.normed = args.feat_proj_layer_norm
        if self.normed:
            self.layer_norm = nn.LayerNorm(args.conv_dim[-1], eps=args.layer_norm_eps)
        self.projection = nn.Linear(args.conv_dim[-1], args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.layer_norm(x) if self.normed else x)


class PositionalConv(nn.Module):
    """A grouped convolution over the positions (weight-norm folded into `weight`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width, kernel = args.hidden_size, args.num_conv_pos_embeddings
        groups = args.num_conv_pos_embedding_groups
        self.conv = nn.Conv1d(width, width, kernel, padding=kernel // 2, groups=groups)
        self.drop_last = kernel % 2 == 0
        self.activation = activation(args.feat_extract_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x.T[None])[0]  # [C, T (+1 for an even kernel)]
        if self.drop_last:
            out = out[:, :-1]
        return self.activation(out).T


class PositionalConvLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width, kernel = args.hidden_size, args.conv_pos_kernel_size
        groups = args.num_conv_pos_embedding_groups
        self.conv = nn.Conv1d(width, width, kernel, padding=kernel // 2, groups=groups)
        self.drop_last = kernel % 2 == 0
        self.layer_norm = nn.LayerNorm(width, elementwise_affine=False)
        self.activation = activation(args.feat_extract_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x.T[None])[0]  # [C, T (+1 for an even kernel)]
        if self.drop_last:
            out = out[:, :-1]
        return self.activation(self.layer_norm(out.T))


class PositionalConvStack(nn.Module):
    """data2vec-audio's positions: plain convolutions, each LayerNorm-ed."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        count = args.num_conv_pos_embeddings
        self.layers = nn.ModuleList(PositionalConvLayer(args) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]
        # [T, C] -> [heads, T, head_dim]
        q, k, v = (
            p(x).view(length, self.heads, -1).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(0, 1).reshape(length, -1))


def relative_buckets(
    length: int, buckets: int, distance: int, device: torch.device
) -> torch.Tensor:
    """WavLM's bucket [T, T] of each key's position relative to each query's: half the
    buckets for keys after the query; in each half, exact distances below a quarter of the
    buckets, then log-spaced up to `distance`."""
    positions = torch.arange(length, device=device)
    relative = positions[None, :] - positions[:, None]
    half = buckets // 2
    exact = half // 2
    bucket = (relative > 0).long() * half
    relative = relative.abs()
    large = torch.log(relative.float() / exact) / math.log(distance / exact) * (half - exact)
    large = torch.clamp((exact + large).long(), max=half - 1)
    return bucket + torch.where(relative < exact, relative, large)


class GatedRelativeAttention(Attention):
    """WavLM's attention: scores plus the shared relative position bias, scaled per head
    and query by a gate of the query's input."""

    def __init__(self, args: ModelArgs, first: bool) -> None:
        super().__init__(args)
        self.buckets, self.distance = args.num_buckets, args.max_bucket_distance
        self.gru_rel_pos_const = nn.Parameter(torch.ones(1, self.heads, 1, 1))
        self.gru_rel_pos_linear = nn.Linear(args.hidden_size // self.heads, 8)
        if first:  # the bias the first layer learns, which the others reuse
            self.rel_attn_embed = nn.Embedding(args.num_buckets, self.heads)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        length = x.shape[0]
        if bias is None:
            buckets = relative_buckets(length, self.buckets, self.distance, x.device)
            bias = self.rel_attn_embed(buckets).permute(2, 0, 1)  # [heads, T, T]
        # [T, C] -> [heads, T, head_dim] -> [heads, T, 2]: two gates, each a sum of four
        gates = self.gru_rel_pos_linear(x.view(length, self.heads, -1).transpose(0, 1))
        gate_a, gate_b = torch.sigmoid(gates.view(self.heads, length, 2, 4).sum(-1)).chunk(2, -1)
        gate = gate_a * (gate_b * self.gru_rel_pos_const[0] - 1.0) + 2.0
        q, k, v = (
            p(x).view(length, self.heads, -1).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=(gate * bias).to(q.dtype))
        return self.out_proj(out.transpose(0, 1).reshape(length, -1)), bias


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.output_dense = nn.Linear(args.intermediate_size, args.hidden_size)
        self.activation = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(self.activation(self.intermediate_dense(x)))


Bias = torch.Tensor | None  # WavLM's relative position bias [heads, T, T]


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.stable = args.do_stable_layer_norm
        self.gated = args.model_type == "wavlm"
        self.attention = GatedRelativeAttention(args, index == 0) if self.gated else Attention(args)
        self.layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.feed_forward = FeedForward(args)
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def attend(self, x: torch.Tensor, bias: Bias) -> tuple[torch.Tensor, Bias]:
        return self.attention(x, bias) if self.gated else (self.attention(x), bias)

    def forward(self, x: torch.Tensor, bias: Bias) -> tuple[torch.Tensor, Bias]:
        """The layer's output, and WavLM's relative position bias (None for the others)."""
        if self.stable:
            attended, bias = self.attend(self.layer_norm(x), bias)
            x = x + attended
            return x + self.feed_forward(self.final_layer_norm(x)), bias
        attended, bias = self.attend(x, bias)
        x = self.layer_norm(x + attended)
        return self.final_layer_norm(x + self.feed_forward(x)), bias


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.stable = args.do_stable_layer_norm
        stack = args.model_type == DATA2VEC
        self.pos_conv_embed = PositionalConvStack(args) if stack else PositionalConv(args)
        self.layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(args, i) for i in range(args.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos_conv_embed(x)
        if not self.stable:
            x = self.layer_norm(x)
        bias = None
        for layer in self.layers:
            x, bias = layer(x, bias)
        return self.layer_norm(x) if self.stable else x


class Wav2Vec2(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.feature_extractor = FeatureEncoder(args)
        self.feature_projection = FeatureProjection(args)
        self.encoder = Encoder(args)


class Model(nn.Module):
    """Wav2Vec2ForCTC (HubertForCTC) under its module names: `logits` of a clip's
    normalized samples."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.wav2vec2 decodes it
    transcribes = True
    family = "wav2vec2"

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.prefix = PREFIXES[args.model_type]
        setattr(self, self.prefix, Wav2Vec2(args))
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size)

    def logits(self, samples: torch.Tensor) -> torch.Tensor:
        """The CTC logits [frames, vocab] of a clip's normalized samples [samples]."""
        body = getattr(self, self.prefix)
        x = body.feature_projection(body.feature_extractor(samples))
        return self.lm_head(body.encoder(x))
