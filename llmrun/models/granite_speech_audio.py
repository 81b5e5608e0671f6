"""Granite Speech's audio encoder: one clip's stacked log-mel features [frames, input_dim]
-> its tokens [tokens, text hidden].

A conformer (GraniteSpeechCTCEncoder): a linear input layer, then blocks of half a
feed-forward, self-attention with Shaw's relative positions inside fixed blocks of
context_size frames (the last block padded, its padding masked), a convolution module
(pointwise, GLU, depthwise, batch norm, SiLU, pointwise), another half feed-forward and a
LayerNorm; after the middle block, a CTC head's softmax is projected back and added.
Granite Speech Plus (cat_hidden_layers) puts the input layer's output (0) or chosen blocks'
(1-based) beside the last block's along the features, in that order; the middle block's is
taken with the CTC head's addition, as transformers adds it in place. Then
a Q-Former (Blip2QFormerModel) whose window_size // downsample_rate learned queries attend
to each window_size frames in turn (the last window padded with zeros, which the queries
see), and a linear layer to the language model's width.

Reference: transformers/models/granite_speech/modeling_granite_speech.py,
transformers/models/granite_speech_plus/modeling_granite_speech_plus.py and
transformers/models/blip_2/modeling_blip_2.py (Blip2QFormer*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class EncoderArgs:
    """GraniteSpeechEncoderConfig's fields (GraniteSpeechPlusEncoderConfig's
    cat_hidden_layers too), the projector's (Blip2QFormerConfig's) and the outer config's
    window."""

    input_dim: int = 160
    num_layers: int = 10
    hidden_dim: int = 1024
    feedforward_mult: int = 4
    num_heads: int = 8
    dim_head: int = 128
    output_dim: int = 42
    context_size: int = 200
    max_pos_emb: int = 512
    conv_kernel_size: int = 15
    conv_expansion_factor: int = 2
    cat_hidden_layers: tuple[int, ...] = ()
    # The batch norms' eps: 0 for weights with their running statistics folded in.
    batch_norm_eps: float = 1e-5
    qformer_hidden_size: int = 1024
    qformer_layers: int = 2
    qformer_heads: int = 16
    qformer_intermediate_size: int = 4096
    qformer_encoder_hidden_size: int = 1024
    qformer_cross_attention_frequency: int = 1
    qformer_layer_norm_eps: float = 1e-12
    window_size: int = 15
    downsample_rate: int = 5
    text_hidden_size: int = 2048


class FeedForward(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(args.hidden_dim)
        self.up_proj = nn.Linear(args.hidden_dim, args.hidden_dim * args.feedforward_mult)
        self.down_proj = nn.Linear(args.hidden_dim * args.feedforward_mult, args.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(self.pre_norm(x))))


class BlockAttention(nn.Module):
    """Attention within blocks of context_size frames, scores q.k plus q.r(i - j), where r
    is the learned embedding of the distance."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        inner = args.dim_head * args.num_heads
        self.args = args
        self.pre_norm = nn.LayerNorm(args.hidden_dim)
        self.to_q = nn.Linear(args.hidden_dim, inner, bias=False)
        self.to_kv = nn.Linear(args.hidden_dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, args.hidden_dim)
        self.rel_pos_emb = nn.Embedding(2 * args.max_pos_emb + 1, args.dim_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args, frames = self.args, len(x)
        block = args.context_size
        blocks = -(-frames // block)
        x = F.pad(self.pre_norm(x), (0, 0, 0, blocks * block - frames))
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        # [frames, inner] -> [blocks, heads, block, dim_head]
        q, k, v = (t.view(blocks, block, args.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        seq = torch.arange(block)
        distances = seq[:, None] - seq[None, :] + args.max_pos_emb
        scale = args.dim_head**-0.5
        bias = torch.einsum("bhcd,crd->bhcr", q, self.rel_pos_emb(distances)) * scale
        real = frames - (blocks - 1) * block
        if real < block:  # the last block's padding: neither queries nor keys
            mask = torch.ones(block, block, dtype=torch.bool)
            mask[:real, :real] = False
            bias[-1].masked_fill_(mask, -torch.finfo(bias.dtype).max)
        scores = q @ k.transpose(-1, -2) * scale + bias
        out = torch.softmax(scores, dim=-1) @ v
        # [blocks, heads, block, dim_head] -> [frames, inner]
        out = out.transpose(1, 2).reshape(blocks * block, -1)[:frames]
        return self.to_out(out)


class DepthwiseConv(nn.Module):
    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.padding = (kernel // 2, kernel // 2 - (kernel + 1) % 2)
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding))


class BatchNorm(nn.Module):
    """An inference batch norm over channels (dim 0 of [channels, frames])."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight / torch.sqrt(self.running_var + self.eps)
        return (x - self.running_mean[:, None]) * scale[:, None] + self.bias[:, None]


class ConvModule(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        inner = args.hidden_dim * args.conv_expansion_factor
        self.norm = nn.LayerNorm(args.hidden_dim)
        self.up_conv = nn.Conv1d(args.hidden_dim, inner * 2, 1)
        self.depth_conv = DepthwiseConv(inner, args.conv_kernel_size)
        self.batch_norm = BatchNorm(inner, args.batch_norm_eps)
        self.down_conv = nn.Conv1d(inner, args.hidden_dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.up_conv(self.norm(x).T), dim=0)  # [channels, frames]
        h = F.silu(self.batch_norm(self.depth_conv(h)))
        return self.down_conv(h).T


class ConformerBlock(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.ff1 = FeedForward(args)
        self.attn = BlockAttention(args)
        self.conv = ConvModule(args)
        self.ff2 = FeedForward(args)
        self.post_norm = nn.LayerNorm(args.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = 0.5 * self.ff1(x) + x
        x = self.attn(x) + x
        x = self.conv(x) + x
        x = 0.5 * self.ff2(x) + x
        return self.post_norm(x)


class Conformer(nn.Module):
    """GraniteSpeechCTCEncoder under its HF names (encoder.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.cat_hidden_layers = set(args.cat_hidden_layers)
        self.input_linear = nn.Linear(args.input_dim, args.hidden_dim)
        self.layers = nn.ModuleList(ConformerBlock(args) for _ in range(args.num_layers))
        self.out = nn.Linear(args.hidden_dim, args.output_dim)
        self.out_mid = nn.Linear(args.output_dim, args.hidden_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.input_linear(features)
        kept = [x] if 0 in self.cat_hidden_layers else []
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if i == len(self.layers) // 2:
                x = x + self.out_mid(torch.softmax(self.out(x), dim=-1))
            if i in self.cat_hidden_layers:
                kept.append(x)
        # [frames, hidden] each -> [frames, hidden * (len(kept) + 1)]
        return torch.cat([*kept, x], dim=-1)


class QFormerAttention(nn.Module):
    """Blip2QFormerAttention: multi-head attention, then dense, residual and LayerNorm."""

    def __init__(self, args: EncoderArgs, source_width: int) -> None:
        super().__init__()
        width = args.qformer_hidden_size
        self.heads = args.qformer_heads
        self.attention = nn.Module()
        self.attention.query = nn.Linear(width, width)
        self.attention.key = nn.Linear(source_width, width)
        self.attention.value = nn.Linear(source_width, width)
        self.output = nn.Module()
        self.output.dense = nn.Linear(width, width)
        self.output.LayerNorm = nn.LayerNorm(width, eps=args.qformer_layer_norm_eps)

    def forward(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        a = self.attention
        # [batch, length, width] -> [batch, heads, length, head width]
        q, k, v = (
            proj(t).unflatten(-1, (self.heads, -1)).transpose(1, 2)
            for proj, t in ((a.query, x), (a.key, source), (a.value, source))
        )
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.output.LayerNorm(self.output.dense(out) + x)


class QFormerLayer(nn.Module):
    """Blip2QFormerLayer for queries alone: self-attention, cross-attention to the
    frames (every cross_attention_frequency-th layer), the queries' feed-forward."""

    def __init__(self, args: EncoderArgs, index: int) -> None:
        super().__init__()
        width = args.qformer_hidden_size
        self.attention = QFormerAttention(args, width)
        if index % args.qformer_cross_attention_frequency == 0:
            self.crossattention = QFormerAttention(args, args.qformer_encoder_hidden_size)
        self.intermediate_query = nn.Module()
        self.intermediate_query.dense = nn.Linear(width, args.qformer_intermediate_size)
        self.output_query = nn.Module()
        self.output_query.dense = nn.Linear(args.qformer_intermediate_size, width)
        self.output_query.LayerNorm = nn.LayerNorm(width, eps=args.qformer_layer_norm_eps)

    def forward(self, queries: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        x = self.attention(queries, queries)
        if hasattr(self, "crossattention"):
            x = self.crossattention(x.expand(len(frames), -1, -1), frames)
        h = self.output_query.dense(F.gelu(self.intermediate_query.dense(x)))
        return self.output_query.LayerNorm(h + x)


class Projector(nn.Module):
    """GraniteSpeechEncoderProjector under its HF names (projector.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        width = args.qformer_hidden_size
        self.query = nn.Parameter(torch.zeros(1, args.window_size // args.downsample_rate, width))
        self.qformer = nn.Module()
        self.qformer.layernorm = nn.LayerNorm(width, eps=args.qformer_layer_norm_eps)
        self.qformer.encoder = nn.Module()
        self.qformer.encoder.layer = nn.ModuleList(
            QFormerLayer(args, i) for i in range(args.qformer_layers)
        )
        self.linear = nn.Linear(width, args.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = self.args.window_size
        windows = math.ceil(len(x) / window)
        # [frames, hidden] -> [windows, window, hidden], the last padded with zeros
        frames = F.pad(x, (0, 0, 0, windows * window - len(x))).view(windows, window, -1)
        queries = self.qformer.layernorm(self.query)
        for layer in self.qformer.encoder.layer:
            queries = layer(queries, frames)
        # [windows, queries, width] -> [windows * queries, width]
        return self.linear(queries.expand(windows, -1, -1).reshape(-1, queries.shape[-1]))


class GraniteSpeechEncoder(nn.Module):
    """The conformer and the projector: one clip's features -> its tokens."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.encoder = Conformer(args)
        self.projector = Projector(args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(features))
