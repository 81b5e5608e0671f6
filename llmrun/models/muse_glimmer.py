"""Muse Glimmer's language model (Meta's Muse-Glimmer-30B; llama.cpp's "muse-glimmer"
GGUFs): token embeddings put through a weightless RMSNorm; sliding-window layers that
rotate (NEOX halves) mixed with global layers without any position encoding (by default
every fourth counted back from the last, where layer_rope_theta is 0); each query and
key head through a weightless RMSNorm, the queries then times qk_scale_factor; attention
outputs gated by sigmoid(gate_proj(x)) before o_proj; four centered norms a layer
(x * (1 + w)), the two after the sublayers with their own epsilon (post_norm_eps); a
SwiGLU feed-forward; a plain RMSNorm last; logits times output_multiplier, then
soft-capped (cap * tanh(logits / cap)).

Reference: transformers/models/muse_glimmer/modeling_muse_glimmer.py
(MuseGlimmerTextModel, MuseGlimmerForConditionalGeneration's head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    GemmaRMSNorm,
    LayerTypes,
    args_from_config,
    attend_scaled,
    check_layer_types,
    head_logits,
    sliding_windows,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    # MuseGlimmerTextConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 19968
    num_key_value_heads: int = 2
    head_dim: int = 128
    hidden_activation: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = 2048
    layer_types: list[str] | None = None
    layer_rope_theta: list[float] | None = None
    qk_scale_factor: float = 3.87
    output_multiplier: float = 0.19611613513818404
    final_logit_softcapping: float | None = 20.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        # Global on every fourth layer counted back from the last, sliding elsewhere.
        nope = [(layers - 1 - i) % 4 == 0 for i in range(layers)]
        if self.layer_types is None:
            self.layer_types = ["full_attention" if n else "sliding_attention" for n in nope]
        self.layer_types = check_layer_types(self.layer_types, layers)
        if self.layer_rope_theta is None:
            theta = self.rope_parameters.get("rope_theta", 10000.0)
            self.layer_rope_theta = [0 if n else theta for n in nope]
        if len(self.layer_rope_theta) != layers:
            raise ModelFormatError(
                f"Muse Glimmer's layer_rope_theta lists {len(self.layer_rope_theta)} layers, "
                f"but the model has {layers}"
            )
        if self.attention_bias:
            raise UnsupportedError("Muse Glimmer with attention_bias=true is not supported")

    @property
    def hidden_act(self) -> str:
        return self.hidden_activation  # GatedMLP's name for it

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # sliding_window: null is no window; final_logit_softcapping: null, no cap.
        return args_from_config(cls, config, nullable=("sliding_window", "final_logit_softcapping"))

    def rotates(self, layer: int) -> bool:
        """Whether `layer` turns its queries and keys (transformers rotates where
        layer_rope_theta is not 0, always by rope_parameters' theta)."""
        return bool(self.layer_rope_theta[layer])

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32, cast back: the
    weightless norm of the embeddings and of each q/k head."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


class Attention(nn.Module):
    """Weightless q/k norms (queries scaled after), RoPE on the rotating layers only, and
    the output gate."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim, self.eps = args.head_dim, args.rms_norm_eps
        self.layer_type = args.layer_types[layer]
        self.rotates = args.rotates(layer)
        self.qk_scale = args.qk_scale_factor
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        self.gate_proj = nn.Linear(args.hidden_size, q_width, bias=False)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, T, H, D], each head normalized on its own, -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = (unit_rms(q, self.eps) * self.qk_scale).transpose(1, 2)
        k = unit_rms(k, self.eps).transpose(1, 2)
        if self.rotates:
            q, k = frame.rotate(q), frame.rotate(k)
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale)
        return self.o_proj(self.heads_out(out) * torch.sigmoid(self.gate_proj(x)))

    def heads_out(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, T, H*D] as the gate takes them (Muse Spark norms each)."""
        return out


class Layer(nn.Module):
    """x + post_attention_norm(attn(input_norm(x))), then
    x + post_feedforward_norm(mlp(pre_feedforward_norm(x))), every norm centered."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        dim, eps, post_eps = args.hidden_size, args.rms_norm_eps, args.post_norm_eps
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, post_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, post_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), frames, cache)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, Layer)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (as CausalLM.forward), scaled and soft-capped.
        `images`: image tokens (llmrun.models.gemma3.ImageTokens, one row) in place of
        their placeholders, seen causally as text is (transformers' mask)."""
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        if images is not None:
            x = images.place(x)
        frames = self.frame(positions, cache, x.dtype, last)
        logits = head_logits(self, x, frames, cache, last_only, last).float()
        logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return unit_rms(self.model.embed_tokens(input_ids), self.args.rms_norm_eps)
