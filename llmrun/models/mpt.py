"""MPT-7B and MPT-30B (MosaicML; llama.cpp's "mpt" GGUFs): ALiBi's bias in attention
(base.Alibi; slopes up to attn_config.alibi_bias_max), one fused Wqkv projection (all
queries, all keys, all values) whose outputs are clamped to +-clip_qkv where the config
sets it, a softmax scale of its own where attn_config gives one, LayerNorms and
projections without biases, and an exact-GELU feed-forward without a gate.

The checkpoints name the modules transformer.wte, transformer.blocks.N and
transformer.norm_f; the loader renames them to llmrun's (llmrun/loading/alibi_families.py).

Reference: transformers/models/mpt/modeling_mpt.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import Alibi, CausalLM, Frame, alibi_slopes, attend_biased
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    d_model: int = 2048
    n_heads: int = 16
    n_layers: int = 24
    expansion_ratio: int = 4
    max_seq_len: int = 2048
    vocab_size: int = 50368
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    attn_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hidden_size, self.num_hidden_layers = self.d_model, self.n_layers
        self.num_attention_heads = self.num_key_value_heads = self.n_heads
        self.head_dim = self.d_model // self.n_heads
        self.max_position_embeddings = self.max_seq_len
        attn = self.attn_config
        self.clip_qkv = attn.get("clip_qkv")
        self.softmax_scale = attn.get("softmax_scale") or self.head_dim**-0.5
        self.alibi_bias_max = attn.get("alibi_bias_max", 8)
        if not attn.get("alibi", True) or attn.get("qk_ln") or attn.get("prefix_lm"):
            raise UnsupportedError(
                "an MPT model without ALiBi, or with q/k LayerNorms or a prefix LM, is not "
                "supported (transformers' MPT has none of them)"
            )
        if self.expansion_ratio != 4:
            raise UnsupportedError(
                f"an MPT feed-forward of expansion_ratio {self.expansion_ratio} is not "
                "supported (transformers' MPT has 4)"
            )

    def alibi_slopes(self) -> torch.Tensor:
        return alibi_slopes(self.n_heads, self.alibi_bias_max)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = set(cls.__dataclass_fields__)
        values = {k: v for k, v in config.items() if k in names and v is not None}
        # MptConfig's attribute_map names, where a config spells them so.
        for alias, name in (("hidden_size", "d_model"), ("num_attention_heads", "n_heads"),
                            ("num_hidden_layers", "n_layers")):  # fmt: skip
            if alias in config:
                values.setdefault(name, config[alias])
        return cls(**values)


class Attention(nn.Module):
    """Wqkv (clamped to +-clip_qkv), split into queries, keys and values, ALiBi-biased
    attention at the config's softmax scale, out_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, args.n_heads, args.head_dim
        self.clip_qkv, self.scale = args.clip_qkv, args.softmax_scale
        self.Wqkv = nn.Linear(args.d_model, 3 * args.d_model, bias=False)
        self.out_proj = nn.Linear(args.d_model, args.d_model, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        # [B, T, 3*H*D] -> [B, T, 3, H, D] -> 3 x [B, H, T, D]
        qkv = qkv.view(batch, tokens, 3, self.n_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        return self.out_proj(attend_biased(q, k, v, self.layer, frame, cache, self.scale))


class MLP(nn.Module):
    """down_proj(gelu(up_proj(x))), exact GELU, no biases."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.up_proj = nn.Linear(args.d_model, 4 * args.d_model, bias=False)
        self.down_proj = nn.Linear(4 * args.d_model, args.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


def layer_norm(args: ModelArgs) -> nn.LayerNorm:
    return nn.LayerNorm(args.d_model, args.layer_norm_epsilon, bias=False)


class DecoderLayer(nn.Module):
    """x + attn(norm_1(x)), then x + ffn(norm_2(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.norm_1 = layer_norm(args)
        self.attn = attention(args, layer)
        self.norm_2 = layer_norm(args)
        self.ffn = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), frame, cache)
        return x + self.ffn(self.norm_2(x))


class Body(nn.Module):
    """The embedding, the blocks and the final LayerNorm (norm_f), no RoPE tables."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = nn.ModuleList(layer(args, i, attention, mlp) for i in range(args.n_layers))
        self.norm = layer_norm(args)


class Model(Alibi, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)
