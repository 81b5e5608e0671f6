"""Ovis2.5's visual tokenizer: an image's patches -> one token per 2x2 patches, in the
language model's width, and the learned embeddings that open and close an image.

A NaViT SigLIP 2 over patch_size² patches: the patch embedding plus the learned square
table of positions resized bicubically to the image's grid (F.interpolate's, corners not
aligned); blocks of LayerNorm, attention with an axial 2D RoPE (Qwen2.5-VL's turning,
llmrun.models.qwen2_vl_vision.rotary_angles) within Qwen2.5-VL's windows of window_size
pixels or over the whole image (layer_types), and a tanh-GELU MLP. The last block's
output (not post_layernorm's, which the reference never reads), each 2x2 group of
patches concatenated, goes through a Linear and a LayerNorm to logits over the visual
vocabulary; their softmax (the last num_visual_indicator_tokens entries, the indicators,
0) weights the rows of the visual embedding table.

The patches come in 2x2 groups row by row (llmrun.ovis2_5_images); the tokens come out
row by row of groups, as Ovis2.5's own code and vLLM hand them to the language model.
transformers 5.25 hands them over in window order instead (Ovis2_5VisionModel records
the last block's output before putting the windows back): the same tokens, in another
order wherever an image spans more than one window.

Reference: transformers/models/ovis2_5/modeling_ovis2_5.py (Ovis2_5VisionModel,
Ovis2_5MultiModalProjector), AIDC-AI/Ovis2.5's modeling_ovis2_5.py (VisualTokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.qwen2_vl_vision import rotary_angles, window_order
from llmrun.models.vision_rope import rotate_heads

LAYER_KINDS = ("full_attention", "window_attention")


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    text_hidden_size: int
    image_size: int = 512
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 1
    window_size: int = 112
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 65536  # the visual vocabulary, indicators included
    num_visual_indicator_tokens: int = 4
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_KINDS
        ):
            raise ModelFormatError(
                f"vision layer_types {self.layer_types!r}: not one of {', '.join(LAYER_KINDS)} "
                f"for each of the {self.num_hidden_layers} layers"
            )
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads "
                "of a multiple of 4 features (the 2D RoPE turns a quarter by rows, a quarter "
                "by columns)"
            )
        if self.image_size % self.patch_size:
            raise ModelFormatError(
                f"vision image_size {self.image_size} is no multiple of patch_size "
                f"{self.patch_size}"
            )
        if self.window_size // self.patch_size // self.spatial_merge_size < 1:
            raise ModelFormatError(
                f"vision window_size {self.window_size} is under one merged token "
                f"({self.patch_size * self.spatial_merge_size} pixels)"
            )
        if not 0 < self.num_visual_indicator_tokens < self.vocab_size:
            raise ModelFormatError(
                f"{self.num_visual_indicator_tokens} visual indicator tokens in a visual "
                f"vocabulary of {self.vocab_size}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def positions_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an Ovis2_5ForConditionalGeneration config.json dict (Ovis2_5VisionConfig's
        defaults where its vision_config leaves fields out)."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("an ovis2_5 config.json without vision_config or text_config")
        if not isinstance(text.get("hidden_size"), int):
            raise ModelFormatError("an ovis2_5 text_config without hidden_size")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedError(
                f"Ovis2.5's vision RoPE type {rope.get('rope_type')!r} (only axial is)"
            )
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedError(f"Ovis2.5's vision hidden_act {act!r} (only gelu_pytorch_tanh)")
        if vision.get("temporal_patch_size", 1) != 1:
            raise UnsupportedError("Ovis2.5's vision temporal_patch_size other than 1")
        return cls(
            hidden_size=vision.get("hidden_size", 1152),
            intermediate_size=vision.get("intermediate_size", 4304),
            num_hidden_layers=vision.get("num_hidden_layers", 27),
            num_attention_heads=vision.get("num_attention_heads", 16),
            text_hidden_size=text["hidden_size"],
            image_size=vision.get("image_size", 512),
            patch_size=vision.get("patch_size", 16),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            window_size=vision.get("window_size", 112),
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", 10000.0),
            vocab_size=vision.get("vocab_size", 65536),
            num_visual_indicator_tokens=vision.get("num_visual_indicator_tokens", 4),
            layer_types=list(vision.get("layer_types") or []),
        )


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        p = args.patch_size
        self.patch_embedding = nn.Conv2d(3, args.hidden_size, p, p)
        self.position_embedding = nn.Embedding(args.positions_side**2, args.hidden_size)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        a, merge = self.args, self.args.spatial_merge_size
        # [N, 3*P*P] -> [N, 3, P, P] -> [N, hidden]
        x = self.patch_embedding(patches.view(-1, 3, a.patch_size, a.patch_size)).flatten(1)
        side = a.positions_side
        # [side², D] -> [1, D, side, side] -> [D, h, w] -> 2x2 groups row by row, as the patches
        table = self.position_embedding.weight.view(side, side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table, (grid_h, grid_w), mode="bicubic", align_corners=False)[0]
        grid = grid.view(-1, grid_h // merge, merge, grid_w // merge, merge)
        return x + grid.permute(1, 3, 2, 4, 0).reshape(grid_h * grid_w, -1)


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        n, dim = x.shape
        # [N, D] -> [N, heads, head_dim]
        q, k, v = (p(x).view(n, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
        out = []
        # Each segment (the whole image, or one window) attends to itself only.
        for qs, ks, vs in zip(*(t.split(segments) for t in (q, k, v)), strict=True):
            # [n, heads, head_dim] -> [1, heads, n, head_dim]
            a = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)))
            out.append(a[0].transpose(0, 1).reshape(-1, dim))
        return self.out_proj(torch.cat(out))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = Attention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, segments)
        return x + self.mlp(self.layer_norm2(x))


class VisionTower(nn.Module):
    """The ViT, with Ovis2_5VisionModel's module names."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        args = self.args
        unit = args.spatial_merge_size**2
        x = self.embeddings(patches, grid_h, grid_w)
        cos, sin = rotary_angles(args, grid_h, grid_w)
        order, windows = window_order(args, grid_h, grid_w)

        def by_window(t: torch.Tensor) -> torch.Tensor:
            # [N, ...] -> [N/unit, unit, ...] reordered by merged token -> [N, ...]
            return t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1)

        x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        whole = [len(x)]
        for layer, kind in zip(self.layers, args.layer_types, strict=True):
            x = layer(x, cos, sin, windows if kind == "window_attention" else whole)
        return x.view(-1, unit, x.shape[-1])[torch.argsort(order)].flatten(0, 1)


class VisualTokenizer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.hidden_size * args.spatial_merge_size**2
        self.visual_vocab = args.vocab_size - args.num_visual_indicator_tokens
        self.linear = nn.Linear(width, self.visual_vocab, bias=False)
        self.norm = nn.LayerNorm(self.visual_vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(self.linear(x)), dim=-1)


class Projector(nn.Module):
    """Ovis2_5MultiModalProjector's modules; the table a row per visual token, as the
    files hold it (vte.weight)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.visual_tokenizer = VisualTokenizer(args)
        self.visual_embeddings_table = nn.Embedding(args.vocab_size, args.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = self.visual_tokenizer(x)
        # The indicators' probabilities are 0: only the first rows of the table are read.
        return probabilities @ self.visual_embeddings_table.weight[: probabilities.shape[-1]]


class VisionModel(nn.Module):
    """patches [grid_h * grid_w, 3 * patch_size²] (2x2 groups row by row) -> tokens
    [grid_h * grid_w / 4, text_hidden_size] (row by row of groups)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args)
        self.multi_modal_projector = Projector(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        merge = self.args.spatial_merge_size
        if grid_h % merge or grid_w % merge:
            raise ModelFormatError(
                f"a grid of {grid_h} x {grid_w} patches does not merge in blocks of {merge}"
            )
        x = self.vision_tower(patches, grid_h, grid_w)
        # [N, D] -> [N/4, 4*D]: each 2x2 group's patches side by side
        return self.multi_modal_projector(x.view(-1, x.shape[-1] * merge * merge))

    def indicators(self) -> torch.Tensor:
        """The table's rows for the indicators [num_visual_indicator_tokens, text hidden]:
        an image's opening embedding, its closing one, then a video's."""
        weight = self.multi_modal_projector.visual_embeddings_table.weight
        return weight[-self.args.num_visual_indicator_tokens :]
