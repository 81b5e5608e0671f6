"""SmallThinker (PowerInfer's SmallThinker-4BA0.6B and -21BA3B; the Hub's
SmallThinkerForCausalLM, model_type "smallthinker", which transformers does not have;
llama.cpp's GGUF arch "smallthinker"): Llama's attention, where each layer rotates or
not (`rope_layout`, 1: RoPE, 0: NoPE) and attends to every earlier position or to the
last sliding_window_size (`sliding_window_layout`, 1: sliding), and a mixture of
experts in every layer whose router reads the layer's input, before the attention's
norm: the top moe_num_active_primary_experts of its logits, weighted by their softmax
(moe_primary_router_apply_softmax) or by their sigmoids renormalized to sum to 1; each
expert down(relu(gate(x)) * up(x)).

Reference: modeling_smallthinker.py and configuration_smallthinker.py of
PowerInfer/SmallThinker-4BA0.6B-Instruct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError
from llmrun.models import llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    LayerTypes,
    RMSNorm,
    args_from_config,
    attend_scaled,
    mix_experts,
    sliding_windows,
)
from llmrun.models.cache import KVCache

DEFAULT_ROPE_THETA = 1e6  # SmallThinkerConfig's, for a config that gives none


@dataclass
class ModelArgs:
    # SmallThinkerConfig's defaults (the 4B's shape).
    hidden_size: int = 1536
    num_hidden_layers: int = 32
    num_attention_heads: int = 12
    vocab_size: int = 151936
    num_key_value_heads: int = 2
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096 * 32
    tie_word_embeddings: bool = True
    rope_layout: list[int] | None = None
    sliding_window_layout: list[int] | None = None
    sliding_window_size: int = 4096
    moe_num_primary_experts: int = 32
    moe_num_active_primary_experts: int = 4
    moe_ffn_hidden_size: int = 768
    moe_primary_router_apply_softmax: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    attention_bias: ClassVar[bool] = False  # llama.Attention's: the published has none

    def __post_init__(self) -> None:
        self.rope_layout = self._layout("rope_layout", self.rope_layout, 1)
        self.sliding_window_layout = self._layout(
            "sliding_window_layout", self.sliding_window_layout, 0
        )
        if any(self.sliding_window_layout) and not (
            isinstance(self.sliding_window_size, int) and self.sliding_window_size > 0
        ):
            raise ModelFormatError(
                f"sliding_window_size is {self.sliding_window_size!r}: sliding layers need a "
                "positive window"
            )
        if not 0 < self.moe_num_active_primary_experts <= self.moe_num_primary_experts:
            raise ModelFormatError(
                f"moe_num_active_primary_experts is {self.moe_num_active_primary_experts}, "
                f"but there are {self.moe_num_primary_experts} experts "
                "(moe_num_primary_experts)"
            )
        self.layer_types = [
            "sliding_attention" if s else "full_attention" for s in self.sliding_window_layout
        ]

    def _layout(self, name: str, value: list[int] | None, default: int) -> list[int]:
        """A per-layer list of 0/1 flags, `default` everywhere where the config has none."""
        if value is None:
            return [default] * self.num_hidden_layers
        if (
            not isinstance(value, list)
            or len(value) != self.num_hidden_layers
            or any(v not in (0, 1) for v in value)
        ):
            raise ModelFormatError(
                f"{name} is {value!r}: it should list 0 or 1 for each of the "
                f"{self.num_hidden_layers} layers (num_hidden_layers)"
            )
        return [int(v) for v in value]

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers, None where there are none."""
        return self.sliding_window_size if any(self.sliding_window_layout) else None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "rope_theta" not in config and not config.get("rope_parameters"):
            config = {**config, "rope_theta": DEFAULT_ROPE_THETA}
        return args_from_config(cls, config)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full-attention layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(llama.Attention):
    """Llama's attention over its layer type's frame, rotating or not (NoPE)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.layer_type = args.layer_types[layer]
        self.use_rope = bool(args.rope_layout[layer])
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        return super().forward(x, frames[self.layer_type], cache)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return frame.rotate(x) if self.use_rope else x

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        # attend_scaled: the sliding layers' cache may keep only their window (frame.plan).
        return attend_scaled(q, k, v, self.layer, frame, cache, self.scale)


class Expert(nn.Module):
    """down(relu(gate(x)) * up(x)): ReGLU."""

    act = staticmethod(F.relu)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.up = nn.Linear(args.hidden_size, args.moe_ffn_hidden_size, bias=False)
        self.gate = nn.Linear(args.hidden_size, args.moe_ffn_hidden_size, bias=False)
        self.down = nn.Linear(args.moe_ffn_hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops.gated(self.act, self.gate(x), self.up(x)))


class SparseMoeBlock(nn.Module):
    """Each token through the top_k experts of its router's logits (of the layer's input),
    weighted by their softmax, or by their sigmoids over the sigmoids' sum."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.moe_num_active_primary_experts
        self.softmax = args.moe_primary_router_apply_softmax
        self.primary_router = nn.Linear(args.hidden_size, args.moe_num_primary_experts, bias=False)
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.moe_num_primary_experts))

    def forward(self, router_input: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        logits = self.primary_router(router_input.reshape(-1, x.shape[-1]))
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        if self.softmax:
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            weights = torch.sigmoid(top.float())
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return mix_experts(x2, weights.to(x.dtype), indices, self.experts).view(x.shape)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + moe(norm(.)) routed by x, the layer's input."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.block_sparse_moe = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), frames, cache)
        return h + self.block_sparse_moe(x, self.post_attention_layernorm(h))


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)
