"""Ovis2's visual tokenizer: square tiles -> one token per hidden_stride² patches of each,
in the language model's width, and the learned embeddings of its indicator tokens.

An AIMv2 ViT over image_size² tiles: the patch embedding, RMSNorm, plus the learned
position of each patch (the tile's grid is the table's); blocks of RMSNorm, attention over
the whole tile and a SwiGLU MLP; RMSNorm. Each hidden_stride x hidden_stride block of
patches concatenated (row by row within it), a Linear and a LayerNorm give logits over the
visual vocabulary; their softmax (the last num_visual_indicator_tokens entries, the
indicators, 0) weights the rows of the visual embedding table.

Reference: transformers/models/ovis2/modeling_ovis2.py (Ovis2VisionModel,
Ovis2Model.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    text_hidden_size: int
    image_size: int = 224
    patch_size: int = 14
    hidden_stride: int = 1
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    mlp_bias: bool = False
    vocab_size: int = 16384  # the visual vocabulary, indicators included
    num_visual_indicator_tokens: int = 5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads"
            )
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.hidden_stride:
            raise ModelFormatError(
                f"vision image_size {self.image_size} is no grid of patch_size "
                f"{self.patch_size} patches in blocks of hidden_stride {self.hidden_stride}"
            )
        if not 0 < self.num_visual_indicator_tokens < self.vocab_size:
            raise ModelFormatError(
                f"{self.num_visual_indicator_tokens} visual indicator tokens in a visual "
                f"vocabulary of {self.vocab_size}"
            )

    @property
    def side(self) -> int:
        """Patches along a tile's side."""
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return (self.side // self.hidden_stride) ** 2

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an Ovis2ForConditionalGeneration config.json dict (Ovis2VisionConfig's
        defaults where its vision_config leaves fields out; the language model's width
        is the outer hidden_size, Ovis2Config's)."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError("an ovis2 config.json without a vision_config")
        text = config.get("text_config") or {}
        width = config.get("hidden_size", text.get("hidden_size", 1536))
        if not isinstance(width, int):
            raise ModelFormatError(f"an ovis2 config.json whose hidden_size is {width!r}")
        act = vision.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"Ovis2's vision hidden_act {act!r} (only silu is)")
        tokenize = vision.get("tokenize_function", "softmax")
        if tokenize != "softmax":
            raise UnsupportedError(
                f"Ovis2's tokenize_function {tokenize!r} (only softmax, the released models')"
            )
        sizes = [vision.get(k, d) for k, d in (("image_size", 224), ("patch_size", 14))]
        if not all(isinstance(v, int) for v in sizes):
            raise UnsupportedError(f"Ovis2's vision image and patch sizes {sizes} (square only)")
        return cls(
            hidden_size=vision.get("hidden_size", 1024),
            intermediate_size=vision.get("intermediate_size", 2816),
            num_hidden_layers=vision.get("num_hidden_layers", 24),
            num_attention_heads=vision.get("num_attention_heads", 8),
            text_hidden_size=width,
            image_size=sizes[0],
            patch_size=sizes[1],
            hidden_stride=vision.get("hidden_stride", 1),
            rms_norm_eps=vision.get("rms_norm_eps", 1e-5),
            qkv_bias=vision.get("qkv_bias", False),
            mlp_bias=vision.get("mlp_bias", False),
            vocab_size=vision.get("vocab_size", 16384),
            num_visual_indicator_tokens=vision.get("num_visual_indicator_tokens", 5),
        )


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        p = args.patch_size
        self.patch_embedding = nn.Conv2d(3, args.hidden_size, p, p)
        self.rms_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.position_embedding = nn.Embedding(args.side**2, args.hidden_size)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        # [T, 3, S, S] -> [T, D, side, side] -> [T, side², D]
        x = self.patch_embedding(tiles).flatten(2).transpose(1, 2)
        return self.rms_norm(x) + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim, bias = args.hidden_size, args.qkv_bias
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, n, dim = x.shape
        # [T, N, D] -> [T, heads, N, head_dim]
        q, k, v = (
            p(x).view(tiles, n, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(tiles, n, dim))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim, inner, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.rms_norm1 = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args)
        self.rms_norm2 = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.rms_norm1(x))
        return x + self.ffn(self.rms_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


class Transformer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.rms_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(tiles)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.rms_norm(x)


class VisionTower(nn.Module):
    """Ovis2VisionModel: the ViT and the head to the visual vocabulary's probabilities."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        visual_vocab = args.vocab_size - args.num_visual_indicator_tokens
        self.transformer = Transformer(args)
        self.head_linear = nn.Linear(
            args.hidden_size * args.hidden_stride**2, visual_vocab, bias=False
        )
        self.head_norm = nn.LayerNorm(visual_vocab)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.transformer(tiles)
        a, stride = self.args, self.args.hidden_stride
        blocks = a.side // stride
        # [T, side², D] -> [T, side/s, s, side/s, s, D] -> [T, (side/s)², s*s*D]
        x = x.view(len(x), blocks, stride, blocks, stride, -1).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(len(x), blocks * blocks, -1)
        return torch.softmax(self.head_norm(self.head_linear(x)), dim=-1)


class VisionModel(nn.Module):
    """tiles [T, 3, image_size, image_size] -> tokens [T, tokens_per_tile,
    text_hidden_size] (each tile's row by row)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args)
        self.visual_embeddings_table = nn.Embedding(args.vocab_size, args.text_hidden_size)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        probabilities = self.vision_tower(tiles)
        # The indicators' probabilities are 0: only the first rows of the table are read.
        return probabilities @ self.visual_embeddings_table.weight[: probabilities.shape[-1]]

    def indicators(self) -> torch.Tensor:
        """The table's rows for the indicator tokens [num_visual_indicator_tokens, text
        hidden], in the order of the config's visual_indicator_token_ids."""
        return self.visual_embeddings_table.weight[-self.args.num_visual_indicator_tokens :]
