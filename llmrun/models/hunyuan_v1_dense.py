"""Hunyuan dense (Tencent Hunyuan 0.5B to 7B; llama.cpp's "hunyuan-dense" GGUFs): Llama
with an RMSNorm over each query and key head applied after RoPE (query_layernorm,
key_layernorm), and NTK-alpha RoPE: rope_type "dynamic" with an `alpha` stretches the
base once, to rope_theta * alpha^(head_dim / (head_dim - 2)), whatever the length.

Reference: transformers/models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, RMSNorm, args_from_config, attend
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, ntk_alpha_as_base(config))


def ntk_alpha_as_base(config: dict[str, Any]) -> dict[str, Any]:
    """The config with NTK-alpha RoPE (rope_type "dynamic" and an alpha) written as the
    plain RoPE of the stretched base it is; any other config as it is."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type"))
    alpha = params.get("alpha")
    if kind != "dynamic" or not alpha:
        return config
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": theta * alpha ** (dim / (dim - 2))}
    plain = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta")}
    return {**plain, "rope_parameters": rope}


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.query_layernorm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # Normalized after the rotation, each head on its own.
        q = self.query_layernorm(frame.rotate(q))
        k = self.key_layernorm(frame.rotate(k))
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
