"""DeepSeek-OCR 2's image encoder: a view [N, 3, S, S] (the padded whole image, or one
crop) -> its tokens [N, queries, text hidden].

SAM's ViT-B: patches through a strided convolution, absolute position embeddings
(resized bicubically, antialiased, where the view's grid differs from the trained one),
pre-norm layers whose attention adds decomposed relative positions (per row and column,
resized linearly to the grid) and runs within 14x14 windows except in the global layers;
then the neck (1x1 and 3x3 convolutions, each followed by a LayerNorm over channels) and
two stride-2 convolutions. The grid's features, then a learned query per output token
(144 for a 768-pixel crop, 256 for the 1024-pixel whole image), go through Qwen2 decoder
layers whose mask lets the grid attend within itself and each query to the grid and the
queries before it; the queries' normed outputs, projected linearly, are the tokens.

Reference: transformers/models/deepseek_ocr2/modeling_deepseek_ocr2.py
(DeepseekOcr2VisionModel, DeepseekOcr2Model.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models.base import RMSNorm
from llmrun.models.vision_rope import rotate


@dataclass
class SamArgs:
    """DeepseekOcr2SamVisionConfig's fields that shape the ViT (HF names and defaults)."""

    hidden_size: int = 768
    output_channels: int = 256
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    image_size: int = 1024
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    mlp_dim: int = 3072
    window_size: int = 14
    global_attn_indexes: list[int] = field(default_factory=lambda: [2, 5, 8, 11])
    downsample_channels: list[int] = field(default_factory=lambda: [512, 896])


@dataclass
class QueryArgs:
    """DeepseekOcr2VisionEncoderConfig's fields (a Qwen2's) that shape the query layers."""

    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 1000000.0})


@dataclass
class EncoderArgs:
    sam: SamArgs
    queries: QueryArgs
    text_hidden_size: int
    # Learned queries of a crop's view and of the whole image's (HF's fixed 144 and 256).
    crop_queries: int = 144
    global_queries: int = 256


class SamAttention(nn.Module):
    def __init__(self, args: SamArgs, window: int) -> None:
        super().__init__()
        self.heads = args.num_attention_heads
        head_dim = args.hidden_size // self.heads
        side = window or args.image_size // args.patch_size
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * side - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * side - 1, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, height, width, dim = x.shape
        # [3, batch * heads, height * width, head_dim]
        qkv = self.qkv(x).reshape(batch, height * width, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, batch * self.heads, height * width, -1).unbind(0)
        rel_h = _relative(self.rel_pos_h, height)  # [height, height, head_dim]
        rel_w = _relative(self.rel_pos_w, width)
        grid_q = q.reshape(-1, height, width, q.shape[-1])
        bias_h = torch.einsum("bhwc,hkc->bhwk", grid_q, rel_h)
        bias_w = torch.einsum("bhwc,wkc->bhwk", grid_q, rel_w)
        bias = (bias_h[..., :, None] + bias_w[..., None, :]).reshape(
            batch, self.heads, height * width, height * width
        )
        out = F.scaled_dot_product_attention(
            q.view(batch, self.heads, height * width, -1),
            k.view(batch, self.heads, height * width, -1),
            v.view(batch, self.heads, height * width, -1),
            attn_mask=bias,
        )
        out = out.view(batch, self.heads, height, width, -1).permute(0, 2, 3, 1, 4)
        return self.proj(out.reshape(batch, height, width, dim))


def _relative(table: torch.Tensor, size: int) -> torch.Tensor:
    """The embeddings [size, size, dim] of each query row's offset from each key row, the
    table resized linearly to 2 * size - 1 offsets where it holds another count."""
    length = 2 * size - 1
    if table.shape[0] != length:
        table = F.interpolate(table.T[None], size=length, mode="linear")[0].T
    offsets = torch.arange(size)[:, None] - torch.arange(size)[None, :] + size - 1
    return table[offsets]


class SamMLP(nn.Module):
    def __init__(self, args: SamArgs) -> None:
        super().__init__()
        self.lin1 = nn.Linear(args.hidden_size, args.mlp_dim)
        self.lin2 = nn.Linear(args.mlp_dim, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(F.gelu(self.lin1(x)))


class SamBlock(nn.Module):
    def __init__(self, args: SamArgs, window: int) -> None:
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attn = SamAttention(args, window)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = SamMLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.window:
            h = self._windowed(h)
        else:
            h = self.attn(h)
        x = x + h
        return x + self.mlp(self.norm2(x))

    def _windowed(self, x: torch.Tensor) -> torch.Tensor:
        """Attention within each window of the grid, padded with zeros to whole windows."""
        batch, height, width, dim = x.shape
        w = self.window
        x = F.pad(x, (0, 0, 0, -width % w, 0, -height % w))
        rows, cols = x.shape[1] // w, x.shape[2] // w
        # [batch * windows, w, w, dim]
        windows = x.reshape(batch, rows, w, cols, w, dim).permute(0, 1, 3, 2, 4, 5)
        out = self.attn(windows.reshape(-1, w, w, dim))
        out = out.reshape(batch, rows, cols, w, w, dim).permute(0, 1, 3, 2, 4, 5)
        return out.reshape(batch, rows * w, cols * w, dim)[:, :height, :width]


class ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of [N, C, H, W]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class PatchEmbed(nn.Module):
    def __init__(self, args: SamArgs) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, args.hidden_size, args.patch_size, stride=args.patch_size)


class Sam(nn.Module):
    """SAM's ViT-B with its neck and the two downsampling convolutions (HF's names:
    model.sam_model.*)."""

    def __init__(self, args: SamArgs) -> None:
        super().__init__()
        side = args.image_size // args.patch_size
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Parameter(torch.zeros(1, side, side, args.hidden_size))
        self.blocks = nn.ModuleList(
            SamBlock(args, 0 if i in args.global_attn_indexes else args.window_size)
            for i in range(args.num_hidden_layers)
        )
        out = args.output_channels
        self.neck = nn.Sequential(
            nn.Conv2d(args.hidden_size, out, 1, bias=False),
            ChannelNorm(out, eps=1e-6),
            nn.Conv2d(out, out, 3, padding=1, bias=False),
            ChannelNorm(out, eps=1e-6),
        )
        first, second = args.downsample_channels
        self.net_2 = nn.Conv2d(out, first, 3, stride=2, padding=1, bias=False)
        self.net_3 = nn.Conv2d(first, second, 3, stride=2, padding=1, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(pixels).permute(0, 2, 3, 1)  # [N, H, W, C]
        pos = self.pos_embed
        if pos.shape[1:3] != x.shape[1:3]:
            pos = F.interpolate(
                pos.permute(0, 3, 1, 2),
                size=x.shape[1:3],
                mode="bicubic",
                align_corners=False,
                antialias=True,
            ).permute(0, 2, 3, 1)
        x = x + pos
        for block in self.blocks:
            x = block(x)
        x = self.neck(x.permute(0, 3, 1, 2))
        return self.net_3(self.net_2(x))  # [N, C, H / 4, W / 4]


class QueryAttention(nn.Module):
    def __init__(self, args: QueryArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.hidden_size // self.heads
        kv = self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.k_proj = nn.Linear(args.hidden_size, kv)
        self.v_proj = nn.Linear(args.hidden_size, kv)
        self.o_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class QueryMLP(nn.Module):
    def __init__(self, args: QueryArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QueryLayer(nn.Module):
    def __init__(self, args: QueryArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = QueryAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = QueryMLP(args)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class QueryDecoder(nn.Module):
    """The Qwen2 layers and final norm (HF's names: model.qwen2_model.model.model.*)."""

    def __init__(self, args: QueryArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(QueryLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class QueryModel(nn.Module):
    def __init__(self, args: QueryArgs) -> None:
        super().__init__()
        self.model = QueryDecoder(args)


class QueryEncoder(nn.Module):
    """The learned queries and their Qwen2 layers (HF's names: model.qwen2_model.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        hidden = args.queries.hidden_size
        self.args = args.queries
        self.query_768 = nn.Embedding(args.crop_queries, hidden)
        self.query_1024 = nn.Embedding(args.global_queries, hidden)
        self.model = QueryModel(args.queries)

    def forward(self, grid: torch.Tensor) -> torch.Tensor:
        """The grid's features [N, P, hidden] -> the queries' outputs [N, Q, hidden]."""
        batch, patches, hidden = grid.shape
        table = self.query_768 if patches <= self.query_768.num_embeddings else self.query_1024
        x = torch.cat([grid, table.weight.expand(batch, -1, -1)], dim=1)
        length = x.shape[1]
        # The grid attends within itself; each query to the grid and to queries up to it.
        position = torch.arange(length)
        mask = position[None, :] <= position[:, None]
        mask[:patches, :patches] = True
        head_dim = hidden // self.args.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.args.rope_parameters["rope_theta"] ** exponents)
        angles = position.float()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        decoder = self.model.model
        for layer in decoder.layers:
            x = layer(x, cos, sin, mask)
        return decoder.norm(x)[:, patches:]


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layers = nn.Linear(args.queries.hidden_size, args.text_hidden_size)


class ImageEncoder(nn.Module):
    """SAM, the query layers and the projector, and the view separator that ends an
    image's tokens (HF's names after model.)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.sam_model = Sam(args.sam)
        self.qwen2_model = QueryEncoder(args)
        self.projector = Projector(args)
        self.view_seperator = nn.Parameter(torch.zeros(args.text_hidden_size))

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        """Views of one size [N, 3, S, S] -> their tokens [N, queries, text hidden]."""
        grid = self.sam_model(views).flatten(2).transpose(1, 2)
        return self.projector.layers(self.qwen2_model(grid))
