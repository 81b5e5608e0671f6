"""Lara Mini (translated/Lara-4-Mini-Base): a hybrid of three layer kinds, by default
repeating linear, sliding, linear, full, sliding:

- "linear_attention": Qwen3.5's Gated DeltaNet (llmrun.models.qwen3_5.GatedDeltaNet),
  its gated output norm at rms_norm_eps;
- "sliding_attention": Qwen3's attention (an RMSNorm on each query and key head) over
  the last sliding_window positions, turned by RoPE;
- "full_attention": the same attention over every earlier position, without RoPE.

Every layer is pre-norm, its RMSNorms plain (weight, not Qwen3.5's 1 + weight), and has
a mixture of experts with a softmax router in float32: the top-k probabilities,
renormalized where norm_topk_prob, plus a shared expert added whole, without a gate
(Flint's, whose router scores by sigmoid). The checkpoints fuse each linear layer's input projections
into one in_proj (rows [q | k | v | z | b | a]), name its norm out_norm and stack the
experts; the loader (llmrun.loading.lara_mini) splits and renames them. The recurrent
layers keep their state in cache.recurrent (llmrun.models.recurrent); the KV cache holds
the attention layers, the sliding ones at full length, masked to their window.

Reference: transformers/models/lara_mini/modular_lara_mini.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import qwen3, qwen3_5
from llmrun.models.base import (
    CausalLM,
    Frame,
    Hybrid,
    RMSNorm,
    args_from_config,
    attend,
    layer_frames,
    mix_experts,
    route,
)
from llmrun.models.cache import KVCache
from llmrun.models.qwen3_moe import MLP

LINEAR, SLIDING, FULL = "linear_attention", "sliding_attention", "full_attention"
# LaraMiniConfig's default pattern, repeated over the layers.
PATTERN = (LINEAR, SLIDING, LINEAR, FULL, SLIDING)


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    # LaraMiniConfig's defaults where they differ from Qwen3.5's.
    head_dim: int = 128
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    linear_num_key_heads: int = 8
    linear_num_value_heads: int = 16
    sliding_window: int | None = 512
    num_experts: int = 128
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [PATTERN[i % len(PATTERN)] for i in range(self.num_hidden_layers)]
        unknown = sorted(set(self.layer_types) - set(PATTERN))
        if unknown:
            raise UnsupportedError(
                f"Lara Mini layer types {unknown} are not supported (supported: "
                f"{', '.join(sorted(set(PATTERN)))})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {self.num_hidden_layers}"
            )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelFormatError("Lara Mini sliding_attention layers need a sliding_window")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelFormatError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple "
                f"of linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.hidden_act != "silu":
            raise UnsupportedError(
                f"Lara Mini with hidden_act {self.hidden_act!r} is not supported (only silu: "
                "its convolutions' activation too)"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def attention_layers(self) -> list[int]:
        """The sliding and full layers, in order: the KV cache's layers."""
        return [i for i, kind in enumerate(self.layer_types) if kind != LINEAR]


class Attention(qwen3.Attention):
    """Qwen3's attention in the KV cache's layer of its place among the attention
    layers, the sliding ones masked to their window and turned by RoPE, the full ones
    not turned."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.attention_layers.index(layer))
        self.layer_type = args.layer_types[layer]
        self.rotary = self.layer_type == SLIDING

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
        if self.rotary:
            q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class SparseMoeBlock(nn.Module):
    """The top-k experts of the router's softmax probabilities over its float32 logits,
    renormalized where norm_topk_prob, plus the shared expert, whole."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        self.shared_expert = MLP(args, args.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        logits = F.linear(x2.float(), self.gate.weight.float())
        weights, indices = route(logits, self.top_k, self.norm_topk_prob)
        routed = mix_experts(x2, weights.to(x2.dtype), indices, self.experts)
        return (routed + self.shared_expert(x2)).view(x.shape)


class DecoderLayer(nn.Module):
    """Pre-norm residual block whose mixer is a Gated DeltaNet or an attention."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        if args.layer_types[layer] == LINEAR:
            self.linear_attn = qwen3_5.GatedDeltaNet(args, layer)
        else:
            self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(normed, frames[FULL], cache)
        else:
            x = x + self.self_attn(normed, frames, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per attention type (the sliding one masks keys beyond the window),
        both carrying the rows' real token counts for the linear layers' state (which
        read the full one)."""
        frames = layer_frames(
            positions, cache, dtype, self.args.sliding_window, self.model.rotary_emb, last=last
        )
        if cache is not None and cache.recurrent is not None:
            counts = cache.recurrent.begin(positions)
            for frame in frames.values():
                frame.counts = counts
        return frames
