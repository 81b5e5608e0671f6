"""Idefics2's image encoder: an image (or one of its four crops) at its own size -> a
fixed number of soft tokens in the language model's width. SigLIP's patch states
(llmrun.models.siglip's layers), each patch given the learned position of where it lies
in the image (NaViT-style fractions, as Idefics3's: llmrun.models.idefics3_vision), then
the connector: a SwiGLU projection to the text's width and a perceiver resampler, whose
learned latents attend (grouped-query, no RoPE) to the projected patches and to
themselves, through `resampler_depth` pre-norm layers, then an RMSNorm.

Reference: transformers/models/idefics2/modeling_idefics2.py (Idefics2VisionEmbeddings,
Idefics2Connector, Idefics2PerceiverResampler, Idefics2Model.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.base import RMSNorm, activation
from llmrun.models.idefics3_vision import position_ids

# Idefics2VisionConfig's and Idefics2PerceiverConfig's defaults, for fields a file leaves out.
VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 32,
}
PERCEIVER_DEFAULTS = {
    "hidden_act": "silu",
    "resampler_n_latents": 64,
    "resampler_depth": 3,
    "resampler_n_heads": 16,
    "resampler_head_dim": 96,
    "num_key_value_heads": 4,
}


@dataclass
class PerceiverArgs:
    hidden_size: int  # the text's
    rms_norm_eps: float
    hidden_act: str
    resampler_n_latents: int
    resampler_depth: int
    resampler_n_heads: int
    resampler_head_dim: int
    num_key_value_heads: int

    def __post_init__(self) -> None:
        for name in (
            "resampler_n_latents",
            "resampler_depth",
            "resampler_n_heads",
            "resampler_head_dim",
            "num_key_value_heads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"perceiver_config's {name} is {value!r}")
        if self.resampler_n_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"the perceiver's {self.resampler_n_heads} heads are not a multiple of its "
                f"{self.num_key_value_heads} key-value heads"
            )
        activation(self.hidden_act)


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    text_intermediate_size: int
    text_hidden_act: str
    perceiver: PerceiverArgs

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an Idefics2ForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        perceiver = config.get("perceiver_config") or {}
        if not all(isinstance(c, dict) for c in (vision, text, perceiver)):
            raise ModelFormatError("an idefics2 config without vision_config or text_config")
        missing = [k for k in ("hidden_size", "intermediate_size") if k not in text]
        if missing:
            raise ModelFormatError(f"an idefics2 text_config without {', '.join(missing)}")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        perceiver = {**PERCEIVER_DEFAULTS, **perceiver}
        # Idefics2Config: the perceiver works in the text's width (and its norm's eps where
        # the file's perceiver_config gives another width).
        eps = text.get("rms_norm_eps", 1e-6)  # MistralConfig's default
        if perceiver.get("hidden_size", 4096) == text["hidden_size"]:
            eps = perceiver.get("rms_norm_eps", 1e-6)
        return cls(
            siglip.VisionArgs.from_config(vision),
            text["hidden_size"],
            text["intermediate_size"],
            text.get("hidden_act", "silu"),
            PerceiverArgs(
                hidden_size=text["hidden_size"],
                rms_norm_eps=eps,
                **{k: perceiver[k] for k in PERCEIVER_DEFAULTS},
            ),
        )


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), no biases (Idefics2MLP)."""

    def __init__(self, dim: int, hidden: int, out: int, act: str) -> None:
        super().__init__()
        self.act = activation(act)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PerceiverAttention(nn.Module):
    """The latents' queries over the keys and values of the context and the latents."""

    def __init__(self, args: PerceiverArgs) -> None:
        super().__init__()
        dim, heads, kv_heads = args.hidden_size, args.resampler_n_heads, args.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, args.resampler_head_dim
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, count, _ = latents.shape
        both = torch.cat([context, latents], dim=1)
        # [N, T, heads * head_dim] -> [N, heads, T, head_dim]
        q = self.q_proj(latents).view(batch, count, self.heads, -1).transpose(1, 2)
        k, v = (
            proj(both).view(batch, both.shape[1], self.kv_heads, -1).transpose(1, 2)
            for proj in (self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, count, -1))


class PerceiverLayer(nn.Module):
    def __init__(self, args: PerceiverArgs) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_latents_norm = RMSNorm(dim, eps)
        self.input_context_norm = RMSNorm(dim, eps)
        self.self_attn = PerceiverAttention(args)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = SwiGLU(dim, 4 * dim, dim, args.hidden_act)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        latents = latents + self.self_attn(
            self.input_latents_norm(latents), self.input_context_norm(context)
        )
        return latents + self.mlp(self.post_attention_layernorm(latents))


class PerceiverResampler(nn.Module):
    def __init__(self, args: PerceiverArgs) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.ones(args.resampler_n_latents, args.hidden_size))
        self.layers = nn.ModuleList(PerceiverLayer(args) for _ in range(args.resampler_depth))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        latents = self.latents.expand(context.shape[0], *self.latents.shape)
        for layer in self.layers:
            latents = layer(latents, context)
        return self.norm(latents)


class Connector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.modality_projection = SwiGLU(
            args.vision.hidden_size,
            args.text_intermediate_size,
            args.text_hidden_size,
            args.text_hidden_act,
        )
        self.perceiver_resampler = PerceiverResampler(args.perceiver)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.perceiver_resampler(self.modality_projection(states))


class ImageEncoder(nn.Module):
    """Images [N, 3, H, W] of one size -> soft tokens [N, latents, text hidden], with HF's
    module names (vision_model, connector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = siglip.VisionTransformer(args.vision)
        self.connector = Connector(args)

    def patch_states(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's hidden states [N, patches, hidden]; the pixels past the last whole
        patch of a side are not seen (the convolution's, and the patch mask's, way)."""
        body, patch = self.vision_model, self.args.vision.patch_size
        rows, columns = pixels.shape[2] // patch, pixels.shape[3] // patch
        # [N, hidden, rows, columns] -> [N, patches, hidden], patches row by row
        x = body.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        positions = position_ids(rows, columns, self.args.vision.patches_per_side)
        x = x + body.embeddings.position_embedding(positions.to(x.device))
        for layer in body.encoder.layers:
            x = layer(x)
        return body.post_layernorm(x)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.connector(self.patch_states(pixels))
