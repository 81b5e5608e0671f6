"""Cohere Compass's language model (CohereLabs/North-Micro-Vision-Instruct,
CohereCompassTextModel): Cohere 2's parallel block, LayerNorms, sliding-window and global
layers and logit_scale, but RoPE on the halves of each head (Qwen3's, where Cohere 2 turns
adjacent pairs), in the layer types whose rope_parameters entry is a dict (a null entry:
no RoPE, as Cohere 2's global layers). Text alone turns as plain RoPE; a prompt's images
and the text after them turn by Qwen3-VL's interleaved M-RoPE, the images' deepstack
features added after the first layers (llmrun.models.mrope).

Reference: transformers/models/cohere_compass/modular_cohere_compass.py
(CohereCompassTextConfig, CohereCompassRotaryEmbedding, CohereCompassAttention,
CohereCompassTextModel).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import cohere2, mrope
from llmrun.models.base import Frame, args_from_config
from llmrun.models.cache import KVCache

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(cohere2.ModelArgs):
    # The layer types that turn by RoPE (rope_parameters' per-type entries that are dicts).
    rope_layer_types: tuple[str, ...] = LAYER_TYPES
    logit_scale: float = 1.0  # CohereCompassForCausalLM's where the file gives none

    def __post_init__(self) -> None:
        if self.layer_types is None:  # CohereCompassTextConfig's default: all global
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        super().__post_init__()
        sections = self.rope_parameters.get("mrope_section")
        if sections is not None and (len(sections) != 3 or sum(sections) != self.head_dim // 2):
            raise ModelFormatError(
                f"Cohere Compass's mrope_section {sections!r} is not three sections of the "
                f"{self.head_dim // 2} rotated pairs of a head"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """The args of a config whose rope_parameters are one per layer type (null: no
        RoPE), or one dict for every layer; the types that turn must turn alike."""
        params = config.get("rope_parameters") or {}
        if not set(params) & set(LAYER_TYPES):
            return args_from_config(cls, config)
        turning = {kind: p for kind, p in params.items() if kind in LAYER_TYPES and p is not None}
        settings = {tuple(sorted((k, str(v)) for k, v in p.items())) for p in turning.values()}
        if len(settings) > 1:
            raise UnsupportedError(
                "Cohere Compass with different RoPE settings per layer type is not supported"
            )
        flat = {**config, "rope_parameters": next(iter(turning.values()), {})}
        args = args_from_config(cls, flat)
        args.rope_layer_types = tuple(turning)
        return args


class Attention(cohere2.Attention):
    """Cohere 2's attention with Qwen3's rotation (halves), in the layer types that turn."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.rotary = self.layer_type in args.rope_layer_types

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(self.attend(q, k, v, frame, cache))


class Model(cohere2.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, attention=Attention)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        images: mrope.MRopeImages | None = None,
    ) -> torch.Tensor:
        """Cohere 2's forward; `images` (one row) in place of their placeholders, which
        with the text after them turn by interleaved M-RoPE, their deepstack features
        added after the first layers."""
        rope = (
            mrope.rope_positions(positions, cache, images) if mrope.shifted(cache, images) else None
        )
        if rope is None:
            return super().forward(input_ids, positions, cache, last_only, last)
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        if images is not None:
            x = images.place(x)
        if images is not None and self.args.rope_parameters.get("mrope_section") is None:
            raise ModelFormatError("Cohere Compass's rope_parameters give no mrope_section")
        cos, sin = mrope.turns(self, rope, cache, images, interleaved=True)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        turned = {"cos": cos[:, None].to(x.dtype), "sin": sin[:, None].to(x.dtype)}
        frames = {
            kind: dataclasses.replace(frame, **turned)
            for kind, frame in self.frames(positions, cache, x.dtype, last).items()
        }
        logits = mrope.deepstack_logits(self, x, frames, cache, images, last_only, last)
        return logits * self.args.logit_scale
