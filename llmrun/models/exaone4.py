"""EXAONE 4.0 (LG AI Research, 1.2B and 32B; llama.cpp's "exaone4" GGUFs): OLMo 2's
norms after each sublayer, an RMSNorm over each query and key head (Qwen3's) before
RoPE, and, where the config has a sliding window (the 32B), a hybrid of windowed
layers that rotate and global layers with no position encoding at all (three local
to each global by default). Without a window every layer is global and rotates.

Reference: transformers/models/exaone4/modeling_exaone4.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.models import olmo2
from llmrun.models.base import (
    Frame,
    LayerTypes,
    RMSNorm,
    args_from_config,
    attend_scaled,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(olmo2.ModelArgs):
    sliding_window: int | None = 4096
    # Every n-th layer global (an int), or a repeated string of L (local) and G (global).
    sliding_window_pattern: int | str | None = 4
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = [self._default_type(i) for i in range(self.num_hidden_layers)]
        self.layer_types = windowed_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window
        )

    def _default_type(self, layer: int) -> str:
        """Exaone4Config's layer type from sliding_window_pattern (all global without a
        window); a string pattern such as "LLLG" as llama.cpp's converter reads it."""
        pattern = self.sliding_window_pattern
        if not self.sliding_window or not pattern:
            return "full_attention"
        if isinstance(pattern, str):
            local = pattern[layer % len(pattern)] == "L"
        else:
            local = (layer + 1) % pattern != 0
        return "sliding_attention" if local else "full_attention"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # sliding_window: null is no window (the 1.2B), not the default 4096.
        return args_from_config(cls, config, nullable=("sliding_window",))

    @property
    def hybrid(self) -> bool:
        """With a sliding window, the global layers go without RoPE."""
        return bool(self.sliding_window)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.layer_type = args.layer_types[layer]
        self.rotary = not args.hybrid or self.layer_type == "sliding_attention"
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], each head normalized on its own
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.rotary:
            q, k = frame.rotate(q), frame.rotate(k)
        # attend_scaled: the sliding layers' cache may keep only their window (frame.plan).
        return self.o_proj(attend_scaled(q, k, v, self.layer, frame, cache, self.scale))


class Model(LayerTypes, olmo2.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention)
