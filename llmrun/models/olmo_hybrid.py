"""OLMo Hybrid (AI2's Olmo-Hybrid-7B): OLMo 3's attention layers (an RMSNorm over each
whole query and key projection, the norms after each sublayer) among Gated DeltaNet
linear-attention layers, three linear layers to each attention one by default.

The linear layers are Qwen3.5's (llmrun.models.qwen3_5.GatedDeltaNet) with three
differences: each beta is 2 sigmoid(b) where linear_allow_neg_eigval (the default), so a
step may reflect the state along a key rather than only erase it; the output norm's eps
is 1e-5 whatever rms_norm_eps says (the reference follows FLA's FusedRMSNormGated); and
the layer is pre-norm, its RMSNorms plain (weight, not 1 + weight). The checkpoints keep
the q, k and v projections and convolutions apart, and name the others their own way; the
loader (llmrun.loading.olmo_hybrid) joins them into Qwen3.5's in_proj_qkv and conv1d
(the convolution's channel order) and renames the rest. The attention layers have no
sliding window and turn by RoPE unless rope_theta is null: then no position encoding at
all (NoPE, which the reference says the released checkpoints use). A null or missing
rope_parameters is RoPE at base 10000, as transformers' config reads it.

Reference: transformers/models/olmo_hybrid/modular_olmo_hybrid.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import olmo2, qwen3_5
from llmrun.models.base import CausalLM, Frame, GatedMLP, Hybrid, RMSNorm, args_from_config
from llmrun.models.cache import KVCache

OUTPUT_NORM_EPS = 1e-5  # the linear layers' gated norm, as the reference fixes it
FULL_EVERY = 4  # OlmoHybridConfig's default pattern: layer i full where i % 4 == 3


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    # OlmoHybridConfig's defaults where they differ from Qwen3.5's; None: derived.
    intermediate_size: int = 11008
    head_dim: int | None = None  # hidden_size / num_attention_heads
    max_position_embeddings: int = 65536
    linear_key_head_dim: int | None = None  # 0.75 hidden_size / key heads
    linear_value_head_dim: int | None = None  # twice the key head's
    linear_num_key_heads: int | None = None  # num_attention_heads
    linear_num_value_heads: int | None = None  # num_attention_heads
    linear_allow_neg_eigval: bool = True
    rotary: bool = True  # False where rope_theta is null: no position encoding

    def __post_init__(self) -> None:
        heads = self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // heads
        self.linear_num_key_heads = self.linear_num_key_heads or heads
        self.linear_num_value_heads = self.linear_num_value_heads or heads
        self.linear_key_head_dim = self.linear_key_head_dim or int(
            0.75 * self.hidden_size / self.linear_num_key_heads
        )
        self.linear_value_head_dim = self.linear_value_head_dim or 2 * self.linear_key_head_dim
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if self.hidden_act != "silu":
            raise UnsupportedError(
                f"OLMo Hybrid with hidden_act {self.hidden_act!r} is not supported (only silu: "
                "its convolutions' activation too)"
            )
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # A null rope_theta (in rope_parameters, or at the top level in the older style)
        # is the reference's NoPE; anything else is an ordinary RoPE setting.
        nested = config.get("rope_parameters")
        rope = nested if isinstance(nested, dict) else config
        rotary = "rope_theta" not in rope or rope["rope_theta"] is not None
        flat = dict(config)
        if not rotary:
            flat.pop("rope_theta", None)
            flat["rope_parameters"] = {"rope_type": "default"}
        args = args_from_config(cls, flat)
        args.rotary = rotary
        return args


def default_layer_types(layers: int) -> list[str]:
    """OlmoHybridConfig's pattern: every fourth layer full attention, the last one where
    that leaves none."""
    kinds = [
        "full_attention" if i % FULL_EVERY == FULL_EVERY - 1 else "linear_attention"
        for i in range(layers)
    ]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return kinds


class Attention(olmo2.Attention):
    """OLMo 2's attention (one RMSNorm over all query heads, one over all key heads),
    the KV cache's layer its place among the attention layers, RoPE where the config
    has it."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.attention_layers.index(layer))
        self.rotary = args.rotary

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # Normalized over all heads at once, then [B, T, H*D] -> [B, H, T, D]
        q = self.q_norm(self.q_proj(x)).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(batch, tokens, self.n_kv_heads, self.head_dim)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(self.attend(q, k, v, frame, cache))


class GatedDeltaNet(qwen3_5.GatedDeltaNet):
    """Qwen3.5's linear attention with betas in [0, 2] (linear_allow_neg_eigval) and its
    output norm at eps 1e-5."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.beta_scale = 2.0 if args.linear_allow_neg_eigval else 1.0
        self.norm = qwen3_5.GatedRMSNorm(self.v_dim, OUTPUT_NORM_EPS)

    def _native_step(self, *args: Any) -> torch.Tensor | None:
        # The native step takes betas of sigmoid(b) alone.
        return super()._native_step(*args) if self.beta_scale == 1.0 else None


class LinearDecoderLayer(nn.Module):
    """x + linear_attn(norm(x)), then x + mlp(norm(x)): pre-norm, as Llama's layers."""

    def __init__(self, args: ModelArgs, layer: int, mlp: type) -> None:
        super().__init__()
        self.linear_attn = GatedDeltaNet(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.linear_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def decoder_layer(args: ModelArgs, layer: int, attention: type, mlp: type) -> nn.Module:
    """Layer `layer`: a linear one, or OLMo 3's post-norm attention layer."""
    if args.layer_types[layer] == "linear_attention":
        return LinearDecoderLayer(args, layer, mlp)
    return olmo2.DecoderLayer(args, layer, attention, mlp)


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, decoder_layer)
