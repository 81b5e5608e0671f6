"""Llama 4's image encoder (Scout, Maverick): tiles [N, 3, S, S] -> soft tokens
[N, (S / patch / 2)², text hidden].

Patches cut as torch's unfold orders each one's pixels (channel, row, column) and
projected by a linear layer without bias; a class token after the patches (not before),
learned position embeddings, a LayerNorm; pre-norm layers (LayerNorm, attention with
biases and 2D RoPE on adjacent pairs of each head's features: the first half of the pairs
turn by the patch's column + 1, the second half by its row + 1, head_dim / 4 frequencies
each, the class token not at all; LayerNorm, fc1-GELU-fc2); a final LayerNorm. The class
token is dropped, the patch grid pixel-shuffled (each 2x2 block of patches into one token
of 4x the features, as InternVL's), then the adapter (fc1, GELU, fc2, GELU, without
biases) and the projector (one linear layer) bring it to the language model's width.

Reference: transformers/models/llama4/modeling_llama4.py (Llama4VisionModel,
Llama4VisionRotaryEmbedding, Llama4VisionPixelShuffleMLP, Llama4MultiModalProjector).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.internvl_vision import pixel_shuffle

# transformers builds every LayerNorm of the tower with PyTorch's default epsilon, whatever
# the config's norm_eps says (Llama 4's is this value too).
NORM_EPS = 1e-5
DEFAULT_THETA = 10000.0  # Llama4VisionConfig's, and what llama.cpp's clip.cpp fixes


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelFormatError(f"vision {name} is {value!r}, not a positive whole number")
    return value


@dataclass
class VisionArgs:
    """Llama4VisionConfig's fields that shape the tower and its adapter (HF names and
    defaults; Scout's and Maverick's: hidden 1408, image_size 336, vision_output_dim 4096)."""

    hidden_size: int = 768
    intermediate_size: int = 5632
    num_hidden_layers: int = 34
    num_attention_heads: int = 16
    image_size: int = 448
    patch_size: int = 14
    num_channels: int = 3
    pixel_shuffle_ratio: float = 0.5
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    vision_output_dim: int = 7680
    rope_theta: float = DEFAULT_THETA
    norm_eps: float = NORM_EPS

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "image_size", "patch_size"):
            _positive(getattr(self, name), name)
        if self.image_size % self.patch_size:
            raise ModelFormatError(
                f"vision image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} does not split into "
                f"{self.num_attention_heads} heads of a multiple of 4 (2D RoPE's pairs per axis)"
            )
        ratio = self.pixel_shuffle_ratio
        if ratio != 0.5:
            raise UnsupportedError(
                f"vision pixel_shuffle_ratio {ratio!r}: llmrun runs Llama 4's 0.5 (2x2 patches a token)"
            )
        if self.patches_per_side % self.merge:
            raise ModelFormatError(
                f"the {self.patches_per_side} patches a side of a tile do not pair up for the "
                "pixel shuffle"
            )
        # The adapter takes the shuffled patches (intermediate_size wide) and keeps one width.
        if self.intermediate_size != self.hidden_size * self.merge**2:
            raise ModelFormatError(
                f"vision intermediate_size {self.intermediate_size} is not 4 x hidden_size "
                f"{self.hidden_size}, the width of a pixel-shuffled token"
            )
        widths = {self.projector_input_dim, self.projector_output_dim, self.vision_output_dim}
        if len(widths) != 1:
            raise ModelFormatError(
                f"vision projector_input_dim {self.projector_input_dim}, projector_output_dim "
                f"{self.projector_output_dim} and vision_output_dim {self.vision_output_dim} "
                "differ; the adapter chains them as one width"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """From a Llama4VisionConfig dict (a vision_config); its RoPE base from
        rope_parameters (transformers 5) or rope_theta (older files)."""
        names = set(cls.__dataclass_fields__) - {"rope_theta", "norm_eps"}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        rope = config.get("rope_parameters") or {}
        values["rope_theta"] = float(
            rope.get("rope_theta", config.get("rope_theta", DEFAULT_THETA))
        )
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def merge(self) -> int:
        """The side of each square of patches shuffled into one token."""
        return round(1 / self.pixel_shuffle_ratio)

    @property
    def tokens_per_tile(self) -> int:
        return (self.patches_per_side // self.merge) ** 2


@dataclass
class EncoderArgs:
    vision: VisionArgs
    text_hidden_size: int


def rope_angles(args: VisionArgs) -> torch.Tensor:
    """The angle of each position (the patches row by row, then the class token) and
    pair of a head's features [patches + 1, head_dim / 2]: pairs of the first half turn by
    (column + 1) x frequency, of the second by (row + 1) x frequency, the frequencies
    theta^(-4j / head_dim); the class token's angles 0 (Llama4VisionRotaryEmbedding)."""
    side = args.patches_per_side
    quarter = args.head_dim // 4
    freqs = 1.0 / args.rope_theta ** (
        torch.arange(quarter, dtype=torch.float32) * 4 / args.head_dim
    )
    index = torch.arange(side * side)
    columns = (index % side + 1).float()[:, None] * freqs
    rows = (index // side + 1).float()[:, None] * freqs
    angles = torch.cat([columns, rows], dim=1)
    return torch.cat([angles, torch.zeros(1, 2 * quarter)])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, T, head_dim] with each adjacent pair (x[2i], x[2i+1]) turned by its
    angle (cos, sin [T, head_dim / 2]), as complex numbers are."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape

        # [N, T, dim] -> [N, heads, T, head_dim]
        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, self.heads, -1).transpose(1, 2)

        q = rotate(split(self.q_proj(x)), cos, sin)
        k = rotate(split(self.k_proj(x)), cos, sin)
        out = F.scaled_dot_product_attention(q, k, split(self.v_proj(x)))  # both ways
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))


class PatchEmbedding(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        width = args.num_channels * args.patch_size**2
        self.linear = nn.Linear(width, args.hidden_size, bias=False)


class AdapterMLP(nn.Module):
    """Llama4VisionMLP2: fc1, GELU, fc2, GELU, without biases."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.intermediate_size, args.projector_input_dim, bias=False)
        self.fc2 = nn.Linear(args.projector_output_dim, args.projector_output_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class VisionAdapter(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.mlp = AdapterMLP(args)


class VisionModel(nn.Module):
    """Tiles [N, 3, S, S] -> the adapter's tokens [N, (S / patch / 2)², vision_output_dim]
    (Llama4VisionModel's last_hidden_state)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        positions = args.patches_per_side**2 + 1
        self.patch_embedding = PatchEmbedding(args)
        self.class_embedding = nn.Parameter(torch.zeros(args.hidden_size))
        self.positional_embedding_vlm = nn.Parameter(torch.zeros(positions, args.hidden_size))
        self.layernorm_pre = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.layernorm_post = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.model = Encoder(args)
        self.vision_adapter = VisionAdapter(args)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        args = self.args
        if tuple(tiles.shape[1:]) != (args.num_channels, args.image_size, args.image_size):
            raise ValueError(f"tiles of shape {list(tiles.shape[1:])}, not 3 x image_size²")
        # [N, C, S, S] -> [N, C * p * p, patches] -> [N, patches, C * p * p], row by row
        patches = F.unfold(tiles, args.patch_size, stride=args.patch_size).mT
        x = self.patch_embedding.linear(patches)
        x = torch.cat([x, self.class_embedding.expand(len(x), 1, -1)], dim=1)
        x = self.layernorm_pre(x + self.positional_embedding_vlm)
        angles = rope_angles(args).to(x.device)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.layernorm_post(x)[:, :-1]  # the class token dropped
        side = args.patches_per_side
        shuffled = pixel_shuffle(x.reshape(len(x), side, side, -1), args.merge)
        return self.vision_adapter.mlp(shuffled.flatten(1, 2))


class MultiModalProjector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(args.vision.vision_output_dim, args.text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


class ImageEncoder(nn.Module):
    """Tiles [N, 3, S, S] -> soft tokens [N, tokens per tile, text hidden], with HF's module
    names (vision_model, multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = VisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_model(tiles))
