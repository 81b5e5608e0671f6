"""Cohere 2 (Command R7B, Command A; llama.cpp's "cohere2" GGUFs): Command-R's
parallel block, LayerNorms, adjacent-pair RoPE and logit_scale, with sliding-window
layers alternating with global ones (three local to each global by default) and no
RoPE at all in the global layers. head_dim is always hidden_size / heads, and there
are no q/k norms.

Reference: transformers/models/cohere2/modeling_cohere2.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import cohere
from llmrun.models.base import (
    Body,
    Frame,
    GatedMLP,
    attend_scaled,
    head_logits,
    layer_frames,
    new_cache,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache
from llmrun.models.gemma3 import ImageTokens


@dataclass
class ModelArgs(cohere.ModelArgs):
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 4
    layer_types: list[str] | None = None

    default_theta: ClassVar[float] = 10000.0  # Cohere2Config sets none of its own

    def __post_init__(self) -> None:
        if self.use_qk_norm:
            raise UnsupportedError("Cohere 2 with use_qk_norm=true is not supported")
        super().__post_init__()
        self.head_dim = self.hidden_size // self.num_attention_heads  # as Cohere2Config
        # transformers' default from `sliding_window_pattern`: every pattern-th layer
        # global, the others local.
        self.layer_types = windowed_layer_types(
            self.layer_types,
            self.num_hidden_layers,
            self.sliding_window,
            self.sliding_window_pattern,
        )

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(cohere.Attention):
    """Command-R's attention; local layers rotate and see a window, global ones do neither."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.layer_type = args.layer_types[layer]
        self.rotary = self.layer_type == "sliding_attention"
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        return super().forward(x, frames[self.layer_type], cache)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        return attend_scaled(q, k, v, self.layer, frame, cache, self.scale)


class Model(nn.Module):
    """embed -> parallel blocks -> norm -> lm_head * logit_scale, with HF's module names."""

    decode_step = None  # see llmrun.models.base.run_layers

    def __init__(
        self,
        args: ModelArgs,
        layer: type = cohere.DecoderLayer,
        attention: type = Attention,
        norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.args = args
        if norm is None:
            norm = cohere.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.model = Body(args, attention, GatedMLP, layer, norm)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        images: ImageTokens | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T];
        [B, 1, vocab] with last_only or `last` (as CausalLM.forward); `images` in place of
        their placeholders (Command A Vision's), seen causally as text is."""
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        if images is not None:
            x = images.place(x)
        frames = self.frames(positions, cache, x.dtype, last)
        logits = head_logits(self, x, frames, cache, last_only, last).float()
        return logits * self.args.logit_scale

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, hidden] of input_ids [B, T]."""
        return self.model.embed_tokens(input_ids)

    def frames(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per layer type: global layers see every earlier position, sliding
        ones the last sliding_window (in a cache that keeps only those: its plan)."""
        return layer_frames(
            positions, cache, dtype, self.args.sliding_window, self.model.rotary_emb, last=last
        )

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.args, batch, max_seq_len, dtype, device)
