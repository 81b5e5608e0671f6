"""OpenELM (apple/OpenELM-270M, -450M, -1_1B, -3B and their -Instruct): a Llama whose
layers grow, each with query and KV head counts and a feed-forward width of its own. A
layer's queries, keys and values come from one qkv_proj (all query heads' rows, then the
keys', then the values'); each query and key head is RMS-normalized (one scale of head_dim
shared by the heads) before RoPE, which turns halves of whole heads; the output matrix is
the token embedding.

Reference: the Hub's modeling_openelm.py (remote code) and llama.cpp's
src/models/openelm.cpp. Parameter names are Llama's; llmrun/loading/openelm.py renames the
Hub's (transformer.layers.N.attn.qkv_proj, ffn.proj_1 holding gate then up, ...) and
turns its config into the fields below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import CausalLM, Frame, GatedMLP, RMSNorm, args_from_config, attend
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    head_dim: int
    vocab_size: int
    num_query_heads: list[int]
    num_kv_heads: list[int]
    intermediate_sizes: list[int]
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_query_heads", "num_kv_heads", "intermediate_sizes"):
            if len(getattr(self, name)) != self.num_hidden_layers:
                raise ModelFormatError(
                    f"OpenELM: {name} lists {len(getattr(self, name))} layers, but the model "
                    f"has {self.num_hidden_layers}"
                )
        for heads, kv_heads in zip(self.num_query_heads, self.num_kv_heads, strict=True):
            if kv_heads <= 0 or heads % kv_heads:
                raise ModelFormatError(f"OpenELM: {heads} query heads cannot share {kv_heads}")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    def cache_shapes(self) -> list[tuple[int, int]]:
        """Each layer's cached (KV heads, head width)."""
        return [(kv_heads, self.head_dim) for kv_heads in self.num_kv_heads]

    def layer_windows(self) -> list[int | None]:
        """One entry per layer: none has a sliding window."""
        return [None] * self.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_query_heads[layer], args.num_kv_heads[layer]
        rows = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, rows, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, (H + 2 Hkv) * D] -> [B, H + 2 Hkv, T, D]
        qkv = self.qkv_proj(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        q, k = frame.rotate(self.q_norm(q)), frame.rotate(self.k_norm(k))
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class DecoderLayer(nn.Module):
    """Pre-norm residual block with the layer's own heads and feed-forward width."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        width = args.intermediate_sizes[layer]
        self.mlp = mlp(
            SimpleNamespace(
                hidden_size=args.hidden_size, intermediate_size=width, hidden_act=args.hidden_act
            )
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, DecoderLayer)

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """A KV cache whose layers each hold their own KV heads."""
        shapes = self.args.cache_shapes()
        return KVCache(
            len(shapes), batch, shapes[0][0], max_seq_len, self.args.head_dim, dtype, device,
            shapes=shapes,
        )  # fmt: skip
