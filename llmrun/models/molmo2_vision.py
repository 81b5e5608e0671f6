"""Molmo 2's image encoder: a ViT over each crop's flattened patches (a linear patch
embedding, a learned position per patch, pre-LayerNorm layers with biased attention and a
tanh-GELU MLP), the outputs of the vision_feature_layer layers joined per patch, then the
adapter: each image token's window of patches (pooling indices, -1 for none) pooled by one
attention whose query is the window's mean, and a SwiGLU projector to the language
model's width.

Reference: transformers/models/molmo2/modeling_molmo2.py (Molmo2VisionModel,
Molmo2Adapter, Molmo2Model.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError

# Molmo2VisionConfig's and Molmo2AdapterConfig's defaults.
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 25,
    "num_attention_heads": 16,
    "head_dim": 72,
    "layer_norm_eps": 1e-6,
    "patch_size": 14,
    "image_size": [378, 378],
    "hidden_act": "gelu_pytorch_tanh",
}
ADAPTER_DEFAULTS = {
    "vision_feature_layer": [24, 18],
    "hidden_size": 1152,
    "num_attention_heads": 16,
    "head_dim": 72,
    "intermediate_size": 18944,
    "hidden_act": "silu",
    "attention_bias": True,
    "mlp_bias": False,
}


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    layer_norm_eps: float
    patch_size: int
    num_position_embeddings: int
    feature_layers: list[int]  # each >= 0, in the order their features are joined
    adapter_hidden_size: int
    adapter_heads: int
    adapter_head_dim: int
    adapter_intermediate_size: int
    adapter_attention_bias: bool
    adapter_mlp_bias: bool
    text_hidden_size: int

    @classmethod
    def from_configs(
        cls, vision: dict[str, Any], adapter: dict[str, Any], text_hidden: int
    ) -> EncoderArgs:
        """From config.json's vision_config and adapter_config, under their defaults."""
        v = {**VISION_DEFAULTS, **{k: x for k, x in vision.items() if x is not None}}
        a = {**ADAPTER_DEFAULTS, **{k: x for k, x in adapter.items() if x is not None}}
        for config, act in ((v, "gelu_pytorch_tanh"), (a, "silu")):
            if config["hidden_act"] != act:
                raise ModelFormatError(f"hidden_act {config['hidden_act']!r}, not Molmo 2's {act}")
        size, patch = v["image_size"], v["patch_size"]
        positions = v.get("num_position_embeddings") or (size[0] // patch) * (size[1] // patch)
        layers = v["num_hidden_layers"]
        wanted = a["vision_feature_layer"]
        if not wanted or not all(-layers <= i < layers for i in wanted):
            raise ModelFormatError(
                f"vision_feature_layer {wanted} does not index the tower's {layers} layers"
            )
        return cls(
            v["hidden_size"], v["intermediate_size"], layers, v["num_attention_heads"],
            v["head_dim"], float(v["layer_norm_eps"]), patch, positions,
            [i % layers for i in wanted], a["hidden_size"], a["num_attention_heads"],
            a["head_dim"], a["intermediate_size"], bool(a["attention_bias"]),
            bool(a["mlp_bias"]), text_hidden,
        )  # fmt: skip


class Attention(nn.Module):
    """Multi-head attention with biases, the keys and values from `context` (x itself in
    the tower), masked where `mask` [.., Q, K] is False."""

    def __init__(self, inputs: int, heads: int, head_dim: int, out: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(inputs, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(inputs, heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(inputs, heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, out, bias=bias)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        def split(t: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
            return t.view(t.shape[0], t.shape[1], self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(context)), split(self.v_proj(context))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = Attention(hidden, args.num_attention_heads, args.head_dim, hidden, True)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer_norm1(x)
        x = x + self.self_attn(h, h)
        return x + self.mlp(self.layer_norm2(x))


class VisionTower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.positional_embedding = nn.Parameter(
            torch.zeros(args.num_position_embeddings, args.hidden_size)
        )
        self.patch_embedding = nn.Linear(args.patch_size**2 * 3, args.hidden_size)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(max(args.feature_layers) + 1))

    def forward(self, patches: torch.Tensor, wanted: list[int]) -> torch.Tensor:
        """Patches [crops, N, patch pixels] -> the outputs of the `wanted` layers joined
        [crops, N, hidden * len(wanted)]."""
        x = self.patch_embedding(patches) + self.positional_embedding
        outputs = []
        for layer in self.layers:
            x = layer(x)
            outputs.append(x)
        return torch.cat([outputs[i] for i in wanted], dim=-1)


class ImageProjector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        hidden, inner, bias = (
            args.adapter_hidden_size,
            args.adapter_intermediate_size,
            args.adapter_mlp_bias,
        )
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, args.text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Adapter(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        joined = args.hidden_size * len(args.feature_layers)
        self.image_pooling_2d = Attention(
            joined, args.adapter_heads, args.adapter_head_dim, args.adapter_hidden_size,
            args.adapter_attention_bias,
        )  # fmt: skip
        self.image_projector = ImageProjector(args)

    def forward(self, features: torch.Tensor, pooling: torch.Tensor) -> torch.Tensor:
        """Joined features [crops, N, width] and pooling indices [tokens, window] into the
        flattened patches -> image tokens [tokens, text hidden] (those with a patch)."""
        flat = features.flatten(0, 1)
        valid = pooling >= 0  # [tokens, window]
        windows = flat[pooling.clamp(min=0)] * valid[..., None].to(flat.dtype)
        counts = valid.sum(-1).clamp(min=1).to(flat.dtype)
        query = windows.sum(-2, keepdim=True) / counts[:, None, None]
        pooled = self.image_pooling_2d(query, windows, valid[:, None, None, :]).squeeze(1)
        return self.image_projector(pooled)[valid.any(-1)]


class ImageEncoder(nn.Module):
    """An image's crops [crops, N, patch pixels] and pooling indices -> its tokens [tokens,
    text hidden], with transformers' module names (vision_tower, multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args)
        self.multi_modal_projector = Adapter(args)

    def forward(self, patches: torch.Tensor, pooling: torch.Tensor) -> torch.Tensor:
        features = self.vision_tower(patches, self.args.feature_layers)
        return self.multi_modal_projector(features, pooling)
