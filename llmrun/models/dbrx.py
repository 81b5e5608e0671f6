"""DBRX (Databricks' DBRX Base and Instruct): LayerNorms without bias before attention
and before the experts; one fused query-key-value projection whose outputs are clamped
to ±clip_qkv; NEOX RoPE; a mixture of experts (16, the top 4 of each token's router
softmax), the chosen weights divided by their p-norm (p = moe_normalize_expert_weights,
1 in the released models: renormalized to sum to 1).

Reference: transformers/models/dbrx/modeling_dbrx.py. The Hub's config.json nests the
attention and feed-forward settings (attn_config, ffn_config) and names the sizes
d_model, n_heads, n_layers, max_seq_len; ModelArgs reads those or the flat names. The
checkpoint's keys (transformer.blocks.N.norm_attn_norm.attn.Wqkv, fused experts
ffn.experts.mlp.w1/v1/w2) are renamed to the module names below at the loader edge
(llmrun.loading.dbrx): model.layers.N.self_attn.Wqkv, mlp.gate, mlp.experts.E.w1/w3/w2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import mixtral
from llmrun.models.base import (
    CausalLM,
    DecoderLayer,
    Frame,
    args_from_config,
    attend,
    mix_experts,
    route,
)
from llmrun.models.cache import KVCache

# The Hub config.json's names -> ModelArgs' (transformers' DbrxConfig.attribute_map)
_TOP_LEVEL = {
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_layers": "num_hidden_layers",
    "max_seq_len": "max_position_embeddings",
}
_ATTN_CONFIG = {"kv_n_heads": "num_key_value_heads", "clip_qkv": "clip_qkv"}
_FFN_CONFIG = {
    "ffn_hidden_size": "intermediate_size",
    "moe_num_experts": "num_local_experts",
    "moe_top_k": "num_experts_per_tok",
    "moe_normalize_expert_weights": "moe_normalize_expert_weights",
}


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 1
    max_position_embeddings: int = 2048
    clip_qkv: float | None = None
    num_local_experts: int = 4
    num_experts_per_tok: int = 1
    moe_normalize_expert_weights: float | None = 1.0
    hidden_act: str = "silu"
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_dim = self.hidden_size // self.num_attention_heads
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ModelFormatError(
                f"moe_top_k is {self.num_experts_per_tok}, but there are "
                f"{self.num_local_experts} experts (moe_num_experts)"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(
            cls, flat_config(config), nullable=("clip_qkv", "moe_normalize_expert_weights")
        )


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """A DBRX config with the Hub's nested and renamed fields under ModelArgs' names.
    The RoPE base: rope_parameters where the file has them (transformers 5 writes them),
    else attn_config's rope_theta (the Hub's files, and llama.cpp's converter's source);
    refused where both are given and differ (transformers 5 ignores attn_config's)."""
    flat = dict(config)
    for old, new in _TOP_LEVEL.items():
        if old in config:
            flat[new] = config[old]
    attn = config.get("attn_config") or {}
    for old, new in _ATTN_CONFIG.items():
        if old in attn:
            flat[new] = attn[old]
    ffn = config.get("ffn_config") or {}
    for old, new in _FFN_CONFIG.items():
        if old in ffn:
            flat[new] = ffn[old]
    if "ffn_act_fn" in ffn:
        flat["hidden_act"] = (ffn["ffn_act_fn"] or {}).get("name", "silu")
    theta = attn.get("rope_theta")
    if theta is not None:
        given = (config.get("rope_parameters") or {}).get("rope_theta")
        if given is None:
            flat["rope_theta"] = theta
        elif given != theta:
            raise ModelFormatError(
                f"DBRX config: rope_parameters' rope_theta ({given}) and attn_config's "
                f"({theta}) differ; which one the model was trained with cannot be told"
            )
    return flat


class Attention(nn.Module):
    """Queries, keys and values from one projection, each output clamped to
    ±clip_qkv (no clamp where it is None), then NEOX RoPE and attention."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim, self.clip = args.head_dim, args.clip_qkv
        width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.Wqkv = nn.Linear(args.hidden_size, width, bias=False)
        self.out_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.Wqkv(x)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        # [B, T, (H + 2 Hkv) * D] -> [B, T, H + 2 Hkv, D] -> [B, H + 2 Hkv, T, D]
        qkv = qkv.view(batch, tokens, -1, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=1)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.out_proj(attend(q, k, v, self.layer, frame, cache))


class SparseMoeBlock(mixtral.SparseMoeBlock):
    """Mixtral's experts (w1 the gate, w3 the up, w2 the down projection), the top-k
    weights of the router's softmax divided by their p-norm (none where p is None)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.norm_p = args.moe_normalize_expert_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = route(self.gate(x2), self.top_k, normalize=False)
        if self.norm_p is not None:
            weights = weights / torch.linalg.vector_norm(
                weights, ord=self.norm_p, dim=-1, keepdim=True
            )
        return mix_experts(x2, weights, indices, self.experts).view(x.shape)


class Layer(DecoderLayer):
    """Pre-norm residual block whose norms are LayerNorms without bias."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        nn.Module.__init__(self)  # DecoderLayer's own would build RMSNorms
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = _layer_norm(args)
        self.post_attention_layernorm = _layer_norm(args)


def _layer_norm(args: ModelArgs) -> nn.LayerNorm:
    return nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, bias=False)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, layer=Layer, norm=_layer_norm(args))
