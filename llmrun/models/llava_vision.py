"""LLaVA's image encoder (LLaVA 1.5 and LLaVA-NeXT): tiles [N, 3, S, S] -> soft tokens
[N, patches, text hidden].

CLIP's vision transformer: patches through a strided convolution (no bias), a class token
in front, learned absolute positions, a LayerNorm before the layers (pre_layrnorm), then
pre-norm layers (attention, quick-GELU MLP). The features are the hidden states after
`feature_layers` layers (-2 by default: all but the last layer, whose weights are then never
used), the class token dropped, concatenated where several layers are named, and projected
by Linear, GELU, Linear to the language model's width (VipLLaVA: after a LayerNorm over
the concatenated layers, five of them by default). LLaVA-NeXT's learned image_newline (one
row of the text width) is held here too; llmrun.llava_images lays the tiles out. Video-LLaVA
(images only) and LLaVA-NeXT-Video (images only) are LLaVA 1.5 and LLaVA-NeXT here.

Reference: transformers/models/clip/modeling_clip.py (CLIPVisionTransformer) and
transformers/models/llava/modeling_llava.py (LlavaMultiModalProjector,
LlavaModel.get_image_features), transformers/models/vipllava/modeling_vipllava.py
(VipLlavaMultiModalProjector).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import activation
from llmrun.models.siglip import Attention  # CLIP's attention is SigLIP's

VIPLLAVA = "vipllava"
# VipLlavaConfig's vision_feature_layer: hidden states concatenated in this order.
VIPLLAVA_LAYERS = [-2, -5, -8, -11, 6]
# The model_types whose tiles are laid out with LLaVA-NeXT's learned image_newline.
NEWLINE_MODEL_TYPES = ("llava_next", "llava_next_video")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELUActivation (CLIP's)."""
    return x * torch.sigmoid(1.702 * x)


def _activation(name: str):
    return quick_gelu if name == "quick_gelu" else activation(name)


@dataclass
class VisionArgs:
    """CLIPVisionConfig's fields that shape the tower (HF names and defaults)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    num_channels: int = 3

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "image_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"vision {name} is {value!r}")
        if not isinstance(self.patch_size, int) or self.image_size % self.patch_size:
            raise ModelFormatError(
                f"vision image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not a multiple of its "
                f"{self.num_attention_heads} heads"
            )
        _activation(self.hidden_act)  # refuses an unknown one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """From a CLIPVisionConfig dict (a vision_config)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class EncoderArgs:
    vision: VisionArgs
    text_hidden_size: int
    # Hidden-state indexes (0: the embeddings after pre_layrnorm, k: after k layers),
    # non-negative; their patches are concatenated in this order.
    feature_layers: list[int]
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    newline: bool = False  # LLaVA-NeXT's image_newline
    projector_norm_eps: float | None = None  # VipLLaVA's LayerNorm before the projector

    def __post_init__(self) -> None:
        layers = self.vision.num_hidden_layers
        if not self.feature_layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= layers
            for i in self.feature_layers
        ):
            raise ModelFormatError(
                f"vision feature layers {self.feature_layers!r} are not hidden states 0..{layers}"
            )
        _activation(self.projector_hidden_act)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a LlavaForConditionalGeneration / LlavaNextForConditionalGeneration (or
        VipLlava-, VideoLlava-, LlavaNextVideoForConditionalGeneration) config.json dict;
        only CLIP towers and the "default" strategy (class token dropped)."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("a LLaVA config without vision_config and text_config")
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedError(
                f"a LLaVA vision tower of type {vision.get('model_type')!r}; llmrun runs CLIP's"
            )
        vip = config.get("model_type") == VIPLLAVA
        # VipLlava has no strategy: it always drops the class token.
        strategy = "default" if vip else config.get("vision_feature_select_strategy", "default")
        if strategy != "default":
            raise UnsupportedError(
                f"LLaVA image features with vision_feature_select_strategy {strategy!r}; "
                "llmrun drops the class token ('default')"
            )
        width = text.get("hidden_size", 4096)  # LlamaConfig's default
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ModelFormatError(f"text_config's hidden_size is {width!r}")
        args = VisionArgs.from_config(vision)
        if vip:  # the Hub's file names it vision_feature_layers
            layer = config.get("vision_feature_layer", config.get("vision_feature_layers"))
            layer = VIPLLAVA_LAYERS if layer is None else layer
        else:
            layer = config.get("vision_feature_layer", -2)
        named = list(layer) if isinstance(layer, list | tuple) else [layer]
        layers = args.num_hidden_layers
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in named):
            raise ModelFormatError(f"vision_feature_layer is {layer!r}")
        return cls(
            args,
            width,
            [i if i >= 0 else layers + 1 + i for i in named],
            config.get("projector_hidden_act", "gelu"),
            # VipLlava's projector always has biases.
            True if vip else config.get("multimodal_projector_bias", True),
            config.get("model_type") in NEWLINE_MODEL_TYPES,
            config.get("projector_layernorm_eps", 1e-5) if vip else None,
        )

    @property
    def layers_run(self) -> int:
        """How many tower layers the features need: the deepest feature layer's."""
        return max(self.feature_layers)


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(dim))
        self.patch_embedding = nn.Conv2d(
            args.num_channels, dim, args.patch_size, stride=args.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(args.patches_per_side**2 + 1, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # [N, C, S, S] -> [N, hidden, S/p, S/p] -> [N, patches, hidden], row by row
        patches = self.patch_embedding(pixels).flatten(2).mT
        classes = self.class_embedding.expand(len(pixels), 1, -1)
        return torch.cat([classes, patches], dim=1) + self.position_embedding.weight


class MLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.act = _activation(args.hidden_act)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.layer_norm_eps
        self.self_attn = Attention(args)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(args)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(args) for _ in range(layers))


class VisionTransformer(nn.Module):
    """CLIPVisionTransformer up to its `layers`-th layer (no post_layernorm, which LLaVA's
    features skip)."""

    def __init__(self, args: VisionArgs, layers: int) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.encoder = Encoder(args, layers)

    def hidden_states(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """[embeddings, after layer 1, ...], each [N, 1 + patches, hidden] (the class first)."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states


class VisionTower(nn.Module):
    """CLIPVisionModel's module names (vision_model.*)."""

    def __init__(self, args: VisionArgs, layers: int) -> None:
        super().__init__()
        self.vision_model = VisionTransformer(args, layers)


class MultiModalProjector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.vision.hidden_size * len(args.feature_layers)
        self.projector_layernorm = (
            None
            if args.projector_norm_eps is None
            else nn.LayerNorm(width, eps=args.projector_norm_eps)
        )
        self.linear_1 = nn.Linear(width, args.text_hidden_size, bias=args.projector_bias)
        self.act = _activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(
            args.text_hidden_size, args.text_hidden_size, bias=args.projector_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.projector_layernorm is not None:
            x = self.projector_layernorm(x)
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEncoder(nn.Module):
    """Tiles [N, 3, S, S] -> soft tokens [N, (S / patch)², text hidden], with HF's module
    names (vision_tower, multi_modal_projector, image_newline)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args.vision, args.layers_run)
        self.multi_modal_projector = MultiModalProjector(args)
        if args.newline:
            self.image_newline = nn.Parameter(torch.zeros(args.text_hidden_size))

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower.vision_model.hidden_states(tiles)
        # The class token dropped from each feature layer's states.
        features = torch.cat([states[i][:, 1:] for i in self.args.feature_layers], dim=-1)
        return self.multi_modal_projector(features)
