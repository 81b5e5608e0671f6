"""EmbeddingGemma (google/embeddinggemma-300m; llama.cpp's "gemma-embedding" GGUFs): Gemma 3's
text model as an encoder. Its layers are Gemma 3's, but every query sees keys on both sides:
a global layer's every real key, a sliding layer's those within sliding_window // 2 positions
either way (transformers' bidirectional window of config.json's sliding_window, llama.cpp's
LLAMA_SWA_TYPE_SYMMETRIC); padded keys are masked. No head: the final norm's states, pooled
by llmrun.embeddings, which then applies the sentence-transformers Dense projections this
model holds (`projections`: 2_Dense and 3_Dense, linear, no activation) before normalizing.

Reference: transformers/models/gemma3/modeling_gemma3.py (Gemma3TextModel with
use_bidirectional_attention), sentence-transformers' Dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models import gemma3
from llmrun.models.base import Frame
from llmrun.models.bert import key_padding_mask

MODEL_TYPE = "gemma_embedding"  # llmrun's name: HF folders say gemma3_text (bidirectional)


@dataclass
class ModelArgs(gemma3.ModelArgs):
    # Linear projections after pooling: {"in_features", "out_features", "bias"} each.
    projections: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # Always bidirectional: Gemma 3's own args refuse the flag that says so.
        causal = {k: v for k, v in config.items() if k != "use_bidirectional_attention"}
        return super().from_config(causal)

    @property
    def half_window(self) -> int | None:
        """How far a sliding layer's query sees, either way."""
        return self.sliding_window // 2 if self.sliding_window else None


class Model(nn.Module):
    """The encoder under Gemma3TextModel's names behind a `model.` prefix (as Gemma 3's
    causal LM holds them), and the projections (`projections.N`)."""

    generates = False  # no LM head: an embedding model (llmrun embed)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = gemma3.Body(args)
        self.projections = nn.ModuleList(
            nn.Linear(p["in_features"], p["out_features"], bias=bool(p.get("bias")))
            for p in args.projections
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Float32 final hidden states [B, T, hidden] of input_ids [B, T] at positions
        [B, T], each row's first lengths[b] tokens real (its padding is never attended to)."""
        body = self.model
        x = body.embed_tokens(input_ids)
        # The scale rounded to the compute dtype, as transformers does.
        x = x * torch.tensor(self.args.hidden_size**0.5).to(x.dtype)
        frames = self.frames(positions, lengths, x.dtype)
        for layer in body.layers:
            x = layer(x, frames, None)
        return body.norm(x).float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings contract's name for forward()."""
        return self(input_ids, positions, lengths)

    def frames(
        self, positions: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, Frame]:
        """A Frame per layer type: every real key for global layers, those within the
        half window either way for sliding ones, each with its own RoPE."""
        tokens = positions.shape[1]
        real = key_padding_mask(lengths, tokens)
        if real is None:
            real = torch.ones(1, 1, 1, tokens, dtype=torch.bool, device=positions.device)
        # Each query sees itself too: a padded query far past the real tokens would see no
        # key, a row torch's math attention gives zeros but a fused kernel may give NaN,
        # which would reach the real rows through 0 * NaN in the next layer.
        own = torch.eye(tokens, dtype=torch.bool, device=positions.device)
        masks = {"full_attention": real | own}
        rotary = {"full_attention": self.model.rotary_emb}
        if self.args.half_window is not None:
            # [B, T, T] -> [B, 1, T, T]
            distance = (positions[:, :, None] - positions[:, None, :]).abs()
            masks["sliding_attention"] = ((distance <= self.args.half_window)[:, None] & real) | own
            rotary["sliding_attention"] = self.model.rotary_emb_local
        frames = {}
        for kind, mask in masks.items():
            cos, sin = rotary[kind](positions)
            # [B, T, D] -> [B, 1, T, D], broadcast over heads
            frames[kind] = Frame(
                positions, 0, tokens, mask, cos[:, None].to(dtype), sin[:, None].to(dtype)
            )
        return frames
