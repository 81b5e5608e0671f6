"""Llama 3.2 Vision's (mllama's) image encoder: a ViT over up to max_num_tiles square tiles
of an image, each tile's patches plus a class token (1601 tokens a 560-pixel tile of 14-pixel
patches) padded to a multiple of 8; gated position embeddings (one table for every tile, one
per aspect ratio and tile) and pre- and post-tile embeddings by aspect ratio; plain layers,
then gated global layers, each over all tiles' tokens together (the mask blocks only pairs of
padding tokens, a padded place or a padding tile's, as transformers' does); the final state,
then the plain layers' hidden states at intermediate_layers_indices interleaved feature by
feature (transformers stacks them on a last axis), through the multi-modal projector to the
text width. Its output is what the language model's
cross-attention layers attend to (llmrun.models.mllama).

Reference: transformers/models/mllama/modeling_mllama.py (MllamaVisionModel,
MllamaModel.multi_modal_projector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError


def supported_ratios(max_tiles: int) -> list[list[int]]:
    """Every grid [rows, columns] of at most max_tiles tiles, in MllamaImageProcessor's order
    (an image's aspect ratio id is its index + 1)."""
    return [
        [rows, columns]
        for rows in range(1, max_tiles + 1)
        for columns in range(1, max_tiles + 1)
        if rows * columns <= max_tiles
    ]


@dataclass
class VisionArgs:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_global_layers: int = 8
    attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    norm_eps: float = 1e-5
    max_num_tiles: int = 4
    vision_output_dim: int = 7680
    hidden_act: str = "gelu"
    intermediate_layers_indices: list[int] = field(default_factory=lambda: [3, 7, 15, 23, 30])
    supported_aspect_ratios: list[list[int]] = field(default_factory=lambda: supported_ratios(4))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """The tower's settings from a vision_config, refused where they do not fit."""
        config = {k: v for k, v in config.items() if v is not None}
        if "num_attention_heads" in config:  # MllamaVisionConfig's alias
            config.setdefault("attention_heads", config["num_attention_heads"])
        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in config.items() if k in names})
        if args.hidden_act != "gelu":
            raise UnsupportedError(f"a vision tower with {args.hidden_act!r}; mllama's is gelu")
        if args.image_size % args.patch_size or args.hidden_size % args.attention_heads:
            raise ModelFormatError(
                f"tiles of {args.image_size} pixels in patches of {args.patch_size}, or "
                f"{args.attention_heads} heads of {args.hidden_size}, do not divide"
            )
        grids = supported_ratios(args.max_num_tiles)
        if [list(r) for r in args.supported_aspect_ratios] != grids:
            # The processor numbers aspect ratios by its own list, which the tables follow.
            raise UnsupportedError(
                f"supported_aspect_ratios {args.supported_aspect_ratios}; the processor's for "
                f"{args.max_num_tiles} tiles are {grids}"
            )
        layers = args.intermediate_layers_indices
        if not layers or any(not 0 <= i < args.num_hidden_layers for i in layers):
            raise ModelFormatError(
                f"intermediate_layers_indices {layers} are not layers of the "
                f"{args.num_hidden_layers} plain ones"
            )
        if args.vision_output_dim != args.hidden_size * (1 + len(layers)):
            raise ModelFormatError(
                f"vision_output_dim is {args.vision_output_dim}, but the final state and "
                f"{len(layers)} intermediate ones of {args.hidden_size} make "
                f"{args.hidden_size * (1 + len(layers))}"
            )
        return args

    @property
    def patches(self) -> int:
        """Tokens a tile: its patches and the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1


class AspectRatioEmbedding(nn.Module):
    """A gated embedding per aspect ratio id, one row per tile, added to every token of it."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.tiles, self.hidden = args.max_num_tiles, args.hidden_size
        self.embedding = nn.Embedding(
            len(args.supported_aspect_ratios) + 1, self.tiles * self.hidden
        )
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, aspect_ratio: torch.Tensor) -> torch.Tensor:
        """x [1, tiles, tokens, hidden]."""
        rows = self.embedding(aspect_ratio).reshape(-1, self.tiles, 1, self.hidden)
        return x + rows * self.gate.tanh()


class PositionEmbedding(nn.Module):
    """Every tile's position table, weighted 1 - tanh(gate), plus each aspect ratio's per
    tile table, weighted tanh(gate)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.tiles, self.patches, self.hidden = args.max_num_tiles, args.patches, args.hidden_size
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(self.patches, self.hidden))
        self.tile_embedding = nn.Embedding(
            len(args.supported_aspect_ratios) + 1, self.tiles * self.patches * self.hidden
        )

    def forward(self, x: torch.Tensor, aspect_ratio: torch.Tensor) -> torch.Tensor:
        gate = self.gate.tanh()
        x = x + (1 - gate) * self.embedding.view(1, 1, self.patches, self.hidden)
        tiles = self.tile_embedding(aspect_ratio).reshape(-1, self.tiles, self.patches, self.hidden)
        return x + gate * tiles


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.heads, self.head_dim = args.attention_heads, args.hidden_size // args.attention_heads
        width = self.heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
            return t.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    """A pre-norm block; a global layer's attention and MLP each weighted by tanh(gate)."""

    def __init__(self, args: VisionArgs, gated: bool) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.full((1,), math.pi / 4))
            self.gate_ffn = nn.Parameter(torch.full((1,), math.pi / 4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), mask)
        x = x + (self.gate_attn.tanh() * attn if self.gated else attn)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * mlp if self.gated else mlp)


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs, layers: int, gated: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(args, gated) for _ in range(layers))


class VisionModel(nn.Module):
    """MllamaVisionModel, under its checkpoint names."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        hidden = args.hidden_size
        self.patch_embedding = nn.Conv2d(
            args.num_channels, hidden, args.patch_size, args.patch_size, bias=False
        )
        self.class_embedding = nn.Parameter(torch.zeros(hidden))
        self.gated_positional_embedding = PositionEmbedding(args)
        self.pre_tile_positional_embedding = AspectRatioEmbedding(args)
        self.post_tile_positional_embedding = AspectRatioEmbedding(args)
        self.layernorm_pre = nn.LayerNorm(hidden)
        self.layernorm_post = nn.LayerNorm(hidden)
        self.transformer = Encoder(args, args.num_hidden_layers, gated=False)
        self.global_transformer = Encoder(args, args.num_global_layers, gated=True)

    def forward(self, pixels: torch.Tensor, aspect_ratio: int, tiles: int) -> torch.Tensor:
        """The features [max_num_tiles, patches, vision_output_dim] of one image's tiles
        pixels [max_num_tiles, 3, S, S] (those past `tiles` padding), of aspect ratio id
        `aspect_ratio` (1-based)."""
        args = self.args
        count, hidden = args.max_num_tiles, args.hidden_size
        ratio = torch.tensor([aspect_ratio], device=pixels.device)
        # [tiles, hidden, S/p, S/p] -> [1, tiles, patches - 1, hidden]
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2)[None]
        x = self.pre_tile_positional_embedding(x, ratio)
        cls = self.class_embedding.expand(count, 1, hidden)
        x = torch.cat([cls, x[0]], dim=1)[None]  # [1, tiles, patches, hidden]
        x = self.layernorm_pre(self.gated_positional_embedding(x, ratio))
        patches = x.shape[2]
        padded = patches + (8 - patches % 8) % 8
        x = F.pad(x, (0, 0, 0, padded - patches))
        # Real tokens: the first `tiles` tiles' unpadded ones; a pair of padding tokens (a
        # padded position or a padding tile) is the only pair masked.
        real = torch.zeros(count, padded, dtype=torch.bool, device=x.device)
        real[:tiles, :patches] = True
        real = real.flatten()
        mask = (real[:, None] | real[None, :])[None, None]
        x = x.view(1, count * padded, hidden)
        kept = {}  # the plain layers' outputs that join the final state
        for i, layer in enumerate(self.transformer.layers):
            x = layer(x, mask)
            if i in args.intermediate_layers_indices:
                kept[i] = x
        x = self.layernorm_post(x).view(1, count, padded, hidden)
        x = self.post_tile_positional_embedding(x, ratio).view(1, count * padded, hidden)
        for layer in self.global_transformer.layers:
            x = layer(x, mask)
        # [1, tiles * padded, hidden] -> [tiles, patches, hidden], the padding cut off
        final = x.view(count, padded, hidden)[:, :patches]
        # The intermediate states interleaved feature by feature (stacked on a last axis),
        # after the final state: [tiles, patches, hidden * (1 + n)].
        kept = torch.stack([kept[i] for i in args.intermediate_layers_indices], dim=-1)
        kept = kept.view(count, padded, -1)[:, :patches]
        return torch.cat([final, kept], dim=-1)


@dataclass
class EncoderArgs:
    vision: VisionArgs
    text_hidden: int


class ImageEncoder(nn.Module):
    """The tower and the projector to the text width: one image's cross-attention states
    [max_num_tiles * patches, text hidden]."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = VisionModel(args.vision)
        self.multi_modal_projector = nn.Linear(args.vision.vision_output_dim, args.text_hidden)

    def forward(self, pixels: torch.Tensor, aspect_ratio: int, tiles: int) -> torch.Tensor:
        features = self.vision_model(pixels, aspect_ratio, tiles)
        return self.multi_modal_projector(features).flatten(0, 1)
