"""Phi-1, Phi-1.5 and Phi-2 (PhiForCausalLM; llama.cpp's "phi2" GGUFs): attention and a
GELU feed-forward without a gate in parallel, both reading one LayerNorm of the input
(Cohere's block, with a LayerNorm that has a bias), RoPE on the first
partial_rotary_factor of each head's features, biases on every projection and on
lm_head, and optional LayerNorms over each head's queries and keys (qk_layernorm).

Reference: transformers/models/phi/modeling_phi.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import cohere
from llmrun.models.base import (
    CausalLM,
    Frame,
    RotaryEmbedding,
    activation,
    args_from_config,
    attend,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    hidden_act: str = "gelu_new"
    tie_word_embeddings: bool = False
    qk_layernorm: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    # transformers' PhiConfig: the rotated share of a head where a config gives none.
    default_partial_rotary_factor: ClassVar[float] = 0.5

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        head_dim = config.get("head_dim")
        if head_dim and head_dim != config["hidden_size"] // config["num_attention_heads"]:
            # transformers' q/k norms would still be hidden / heads wide.
            raise UnsupportedError(
                f"a Phi model with heads of {head_dim} features, not hidden size / heads, "
                "is not supported"
            )
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "partial_rotary_factor" not in config and "partial_rotary_factor" not in params:
            config = {**config, "partial_rotary_factor": cls.default_partial_rotary_factor}
        return args_from_config(cls, config)


class Attention(nn.Module):
    """Queries, keys and values (optionally LayerNormed per head) rotated on their first
    rotary_dim features, attended, projected by `dense`; every projection biased."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim)
        self.dense = nn.Linear(self.n_heads * self.head_dim, args.hidden_size)
        self.qk_layernorm = args.qk_layernorm
        if self.qk_layernorm:
            # One norm for every head, over its features.
            self.q_layernorm = nn.LayerNorm(self.head_dim, args.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, args.layer_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, T, H, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # [B, T, H, D] -> [B, H, T, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.dense(attend(q, k, v, self.layer, frame, cache))


class MLP(nn.Module):
    """fc2(act(fc1(x))): no gate, both biased."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(cohere.DecoderLayer):
    """Cohere's parallel block, x + attn(ln(x)) + mlp(ln(x)), its LayerNorm biased."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)


class Body(nn.Module):
    """The embedding, the layers, the final norm under its Hugging Face name
    (final_layernorm) and the RoPE tables."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.final_layernorm = norm
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.final_layernorm


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        super().__init__(args, Attention, MLP, DecoderLayer, norm, body=Body)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size)
