"""Maple (deepgrove/maple-preview): Mellum's layout (Qwen3-MoE's attention and experts in
global and sliding-window layers, layer_types) with RoPE on the sliding layers alone
(nope_on_global_attention), turning the first partial_rotary_factor of each head, one
RoPE for both layer types, and the experts' SwiGLU clamped: silu(min(gate, 7)) *
clamp(up, +-7).

Reference: llama.cpp's src/models/maple.cpp and conversion/maple.py (which asserts what
it runs: SiLU, no shared experts, renormalized top-k, NoPE global layers, and writes the
remote code's clamp of 7). Parameter names are the Hub's checkpoint keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import UnsupportedError
from llmrun.models import deepseek_v4, mellum
from llmrun.models.base import Frame, TopKExperts, args_from_config, rope_parameters
from llmrun.models.cache import KVCache

SWIGLU_LIMIT = 7.0  # modeling_maple.py's, as conversion/maple.py writes it


@dataclass
class ModelArgs(mellum.ModelArgs):
    nope_on_global_attention: bool = True
    num_shared_experts: int = 0
    swiglu_limit: float = SWIGLU_LIMIT

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.nope_on_global_attention or self.num_shared_experts or not self.norm_topk_prob:
            raise UnsupportedError(
                "Maple is supported with NoPE global layers, no shared experts and "
                "renormalized top-k weights only (what llama.cpp runs)"
            )
        if self.hidden_act != "silu":
            raise UnsupportedError(f"Maple with hidden_act {self.hidden_act!r} is not supported")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "num_experts" not in config and "num_local_experts" in config:
            config = {**config, "num_experts": config["num_local_experts"]}
        args = args_from_config(cls, config, nullable=("sliding_window",))
        args.rope_local_parameters = rope_parameters(config)
        return args


class Attention(mellum.Attention):
    """Mellum's attention (per-head q/k norms, the layer type's frame and window), with
    RoPE on the sliding layers only."""

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.layer_type == "sliding_attention":
            q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(self.attend(q, k, v, frame, cache))


class SparseMoeBlock(TopKExperts):
    """The top-k experts of the router's softmax, renormalized, each a clamped SwiGLU."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, args.num_experts, lambda: deepseek_v4.Expert(args), True)


class Layer(mellum.Layer):
    moe = SparseMoeBlock


class Model(mellum.Model):
    attention = Attention
    layer = Layer
