"""Gemma 3 (text; of a multimodal checkpoint, its language model): Gemma 2 without
the attention soft-capping, with an RMSNorm on each query and key head, five
local layers to each global one by default, and its own RoPE base (and scaling)
for each kind of layer.

Reference: transformers/models/gemma3/modeling_gemma3.py (Gemma3ForCausalLM).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import gemma2
from llmrun.models.base import (
    Frame,
    GemmaRMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    rope_parameters,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache

# transformers' Gemma3TextConfig defaults, for configs that leave a base out.
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # global layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        if self.use_bidirectional_attention:
            raise UnsupportedError("Gemma 3 with use_bidirectional_attention=true is not supported")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.hidden_act = self.hidden_activation  # the name GatedMLP reads
        # transformers' default layer types from the older `sliding_window_pattern`:
        # every pattern-th layer global, the others local.
        self.layer_types = windowed_layer_types(
            self.layer_types,
            self.num_hidden_layers,
            self.sliding_window,
            self.sliding_window_pattern,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # A multimodal (Gemma3ForConditionalGeneration) config: its language model.
        config = config.get("text_config") or config
        ropes = rope_by_layer_type(config)
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        args = args_from_config(cls, flat, nullable=("final_logit_softcapping",))
        args.rope_parameters = ropes["full_attention"]
        args.rope_local_parameters = ropes["sliding_attention"]
        return args

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


def rope_by_layer_type(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE settings for global and sliding layers, from either config style:
    transformers 5's `rope_parameters` {full_attention: {...}, sliding_attention:
    {...}}, or the older rope_theta + rope_scaling (global layers) and
    rope_local_base_freq (sliding layers, never scaled)."""
    nested = config.get("rope_parameters")
    if isinstance(nested, dict) and set(nested) & set(DEFAULT_THETA):
        return {
            kind: rope_parameters(
                {
                    **config,
                    "rope_parameters": {
                        "rope_theta": DEFAULT_THETA[kind],
                        **(nested.get(kind) or {"rope_type": "default"}),
                    },
                }
            )
            for kind in DEFAULT_THETA
        }
    full = {k: v for k, v in config.items() if k != "rope_local_base_freq"}
    full.setdefault("rope_theta", DEFAULT_THETA["full_attention"])
    local = config.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"])
    return {
        "full_attention": rope_parameters(full),
        "sliding_attention": rope_parameters({"rope_theta": local}),
    }


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
        self.scale = args.query_pre_attn_scalar**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q.transpose(1, 2)), frame.rotate(k.transpose(1, 2))
        return self.o_proj(attend_scaled(q, k, v, self.layer, frame, cache, self.scale))


class DecoderLayer(gemma2.DecoderLayer):
    """Gemma 2's layer with Gemma 3's attention."""

    attention = Attention


class Body(gemma2.Body):
    """Gemma 2's body with a RoPE of their own for the sliding layers."""

    layer = DecoderLayer

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, args.max_position_embeddings
        )


@dataclass
class ImageTokens:
    """The image soft tokens of a one-row forward (llmrun.models.gemma3_vision makes
    them): their embeddings [n, hidden] in the order of the placeholder tokens they
    replace, and `groups` [T], for each token of the forward the image it belongs to, -1
    for text. The tokens of one image attend to each other both ways (transformers'
    token_type_ids mask, llama.cpp's non-causal image batch); an image must lie whole in
    one forward."""

    embeds: torch.Tensor
    groups: torch.Tensor

    def place(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, hidden] with the image tokens' rows replaced (not scaled)."""
        x[0, self.groups >= 0] = self.embeds.to(x.dtype)
        return x

    def unmask(self, frames: dict[str, Frame], window: int | None) -> dict[str, Frame]:
        """The frames with each image's tokens seeing each other: (causal or same image),
        and on sliding layers within the window, as transformers composes them."""
        groups = self.groups
        tokens = groups.shape[0]
        same = (groups[:, None] == groups[None, :]) & (groups[:, None] >= 0)  # [T, T]
        index = torch.arange(tokens, device=groups.device)
        near = index[:, None] - index[None, :] < (window or tokens + 1)
        out = {}
        for kind, frame in frames.items():
            if frame.mask is None:  # one token: it sees itself already
                out[kind] = frame
                continue
            # The forward's own keys are the mask's last T columns, in order (after the
            # cached prefix, or a windowed layer's ring).
            mask = frame.mask.clone()
            mask[..., -tokens:] |= same & near if kind == "sliding_attention" else same
            out[kind] = dataclasses.replace(frame, mask=mask)
        return out


class Model(gemma2.Model):
    """Gemma 2's model (its soft-cap where final_logit_softcapping is set) of Gemma 3's
    body, taking images."""

    body = Body
