"""Preferred Networks' PLaMo 3 (plamo-3-nict-2b/8b/31b): PLaMo 2's layers (llmrun.models.plamo2:
offset norms before and after the mixer and the feed-forward, one qkv_proj, SwiGLU from
one gate_up_proj) with attention in every layer, q and k normalized per head by one shared
weight each (q_norm, k_norm: offset 1), sliding-window layers with a RoPE base of their
own (rope_local_theta) and every sliding_window_pattern-th layer global.

Reference: llama.cpp's src/models/plamo3.cpp (the Hub's modeling code is remote code).
Parameter names are the Hub's keys but for its layers' "model.layers.layers.N." here
"model.layers.N." (llmrun/loading/plamo3.py renames).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import plamo2
from llmrun.models.base import (
    CausalLM,
    Frame,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    check_layer_types,
    layer_frames,
    rope_parameters,
)
from llmrun.models.cache import KVCache

# The config names llama.cpp's converter reads for each RoPE base (conversion/base.py).
GLOBAL_THETA = ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta")
LOCAL_THETA = (
    "local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
    "rope_local_base_freq",
)  # fmt: skip


@dataclass
class ModelArgs:
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 8192
    vocab_size: int = 100000
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    layer_types: list[str] | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # global layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        self.layer_types = check_layer_types(
            self.layer_types or ["full_attention"] * layers, layers
        )
        for rope in (self.rope_parameters, self.rope_local_parameters):
            if rope.get("rope_type", "default") != "default":
                raise UnsupportedError(
                    f"PLaMo 3 RoPE type {rope['rope_type']!r} is not supported (supported: default)"
                )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """From the Hub's config.json: the window (window_size or sliding_window) on all but
        every sliding_window_pattern-th layer, as llama.cpp's load_swa_pattern(8) sets it."""
        if config.get("rope_scaling_factor", 1) != 1:
            raise UnsupportedError("PLaMo 3 with rope_scaling_factor (YaRN) is not supported")
        config = dict(config)
        window = config.get("window_size", config.get("sliding_window"))
        pattern = config.get("sliding_window_pattern", 8)
        if config.get("layer_types") is None and window:
            config["layer_types"] = [
                "sliding_attention"
                if pattern == 0 or i % pattern < pattern - 1
                else "full_attention"
                for i in range(config.get("num_hidden_layers", 24))
            ]
        config["sliding_window"] = window
        theta = next((config[k] for k in GLOBAL_THETA if k in config), 10000.0)
        local = next((config[k] for k in LOCAL_THETA if k in config), theta)
        args = args_from_config(cls, {**config, "rope_theta": theta})
        if not config.get("rope_local_parameters"):
            args.rope_local_parameters = rope_parameters({**config, "rope_theta": local})
        return args

    @property
    def hidden_size_per_head(self) -> int:
        return self.head_dim

    @property
    def layers_block_type(self) -> list[str]:
        return ["attention"] * self.num_hidden_layers

    @property
    def attention_layers(self) -> list[int]:
        return list(range(self.num_hidden_layers))

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return [
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        ]


class Attention(nn.Module):
    """`layer`: its index (every layer attends); its layer type picks its frame."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.layer_type = layer, args.layer_types[layer]
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.q_norm = plamo2.OffsetRMSNorm(self.head_dim, args.rms_norm_eps, 1.0)
        self.k_norm = plamo2.OffsetRMSNorm(self.head_dim, args.rms_norm_eps, 1.0)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, kv, kv], -1)
        # [B, T, H*D] -> [B, H, T, D], q and k normalized per head
        q = self.q_norm(q.view(batch, tokens, self.n_heads, -1)).transpose(1, 2)
        k = self.k_norm(k.view(batch, tokens, self.n_kv_heads, -1)).transpose(1, 2)
        v = v.view(batch, tokens, self.n_kv_heads, -1).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        # attend_scaled: a sliding layer's cache may keep only its window (frame.plan).
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.head_dim**-0.5)
        return self.o_proj(out)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, plamo2.MLP, plamo2.DecoderLayer, body=plamo2.Body)
        self.model.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, args.max_position_embeddings
        )

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per layer type, each with its RoPE; the sliding layers see the last
        sliding_window positions (in a cache that keeps only those: its plan)."""
        return layer_frames(
            positions, cache, dtype, self.args.sliding_window, self.model.rotary_emb,
            self.model.rotary_emb_local, last=last,
        )  # fmt: skip
