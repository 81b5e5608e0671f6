"""GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B and their fine-tunes; llama.cpp's
"gptneox" GGUFs): LayerNorms with biases, one fused query_key_value projection whose
rows hold each head's query, key and value side by side ([heads, 3, head_dim]), RoPE
turning halves (NEOX) of the first partial_rotary_factor of each head's features (the
Hub's config.json says rotary_pct and rotary_emb_base), a GELU feed-forward without a
gate, and either the parallel residual x + attn(ln1(x)) + mlp(ln2(x))
(use_parallel_residual, the default) or the sequential one. Persimmon
(PersimmonForCausalLM: adept/persimmon-8b-base and -chat) is the sequential model with
LayerNorms of each head's queries and keys before RoPE (qk_layernorm, one LayerNorm
shared by the heads), a squared-ReLU feed-forward and half of each head rotated by
default; its checkpoints' names are renamed by llmrun/loading/persimmon.py. GPT-NeoX
Japanese (GPTNeoXJapaneseForCausalLM: abeja/gpt-neox-japanese-2.7b) is the sequential
model without biases but one added after the last layer's attention (dense_bias), its
feed-forward intermediate_multiple_size times the hidden size, every feature rotated by
default; llmrun/loading/gpt_neox_japanese.py renames its checkpoints.

Reference: transformers/models/gpt_neox/modeling_gpt_neox.py, persimmon/
modeling_persimmon.py, gpt_neox_japanese/modeling_gpt_neox_japanese.py. Parameter names are
transformers 5's with model. for gpt_neox. (llmrun/loading/gpt_neox.py renames the Hub's
gpt_neox. and embed_out.).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models.base import (
    CausalLM,
    Frame,
    RotaryEmbedding,
    activation,
    args_from_config,
    attend,
)
from llmrun.models.cache import KVCache
from llmrun.models.nemotron import RELU2, relu_squared

# The Hub's config.json names (GPTNeoXConfig reads them into rope_parameters) and
# transformers' defaults for them.
ROPE_ALIASES = {
    "rotary_pct": ("partial_rotary_factor", 0.25),
    "rotary_emb_base": ("rope_theta", 10000.0),
}
# GPTNeoXJapaneseConfig reads the same names, with every feature rotated by default.
JAPANESE_ROPE_ALIASES = {**ROPE_ALIASES, "rotary_pct": ("partial_rotary_factor", 1.0)}


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    use_parallel_residual: bool = True
    attention_bias: bool = True
    qk_layernorm: bool = False
    mlp_bias: bool = True
    last_layer_dense_bias: bool = False
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("model_type") == "persimmon":
            # PersimmonConfig's defaults; its RoPE settings are read as any config.json's.
            defaults = {"hidden_act": RELU2, "qk_layernorm": True, "partial_rotary_factor": 0.5}
            return args_from_config(cls, {**defaults, **config, "use_parallel_residual": False})
        aliases = ROPE_ALIASES
        if config.get("model_type") == "gpt_neox_japanese":
            config = japanese_config(config)
            aliases = JAPANESE_ROPE_ALIASES
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        for old, (new, default) in aliases.items():
            params.setdefault(new, config.get(old, default))
        return args_from_config(cls, {**config, "rope_parameters": params})


def japanese_config(config: dict[str, Any]) -> dict[str, Any]:
    """A GPT-NeoX Japanese config.json as GPT-NeoX's fields, GPTNeoXJapaneseConfig's
    defaults where it gives none."""
    config = {"intermediate_multiple_size": 4, "tie_word_embeddings": True, **config}
    return {
        **config,
        "intermediate_size": int(config["hidden_size"] * config["intermediate_multiple_size"]),
        "use_parallel_residual": False,
        "attention_bias": False,
        "mlp_bias": False,
        "last_layer_dense_bias": True,
    }


class Attention(nn.Module):
    """The fused projection's per-head queries, keys and values, the queries and keys
    (LayerNorm-ed first with qk_layernorm) rotated on their first rotary_dim features,
    attended and projected by `dense`."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        width = self.n_heads * self.head_dim
        self.query_key_value = nn.Linear(args.hidden_size, 3 * width, bias=args.attention_bias)
        self.dense = nn.Linear(width, args.hidden_size, bias=args.attention_bias)
        if args.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, args.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, args.layer_norm_eps)
        self.qk_layernorm = args.qk_layernorm
        self.dense_bias = None
        if args.last_layer_dense_bias and layer == args.num_hidden_layers - 1:
            self.dense_bias = nn.Parameter(torch.zeros(args.hidden_size))

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H * 3 * D] -> [B, H, T, 3 * D] -> three [B, H, T, D]
        qkv = self.query_key_value(x).view(batch, tokens, self.n_heads, 3 * self.head_dim)
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = frame.rotate(q), frame.rotate(k)
        out = self.dense(attend(q, k, v, self.layer, frame, cache))
        return out if self.dense_bias is None else out + self.dense_bias


class MLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x))), both biased unless mlp_bias is false."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.dense_4h_to_h = nn.Linear(args.intermediate_size, args.hidden_size, args.mlp_bias)
        self.act = relu_squared if args.hidden_act == RELU2 else activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class DecoderLayer(nn.Module):
    """x + attn(ln1(x)) + mlp(ln2(x)) with the parallel residual, else h = x +
    attn(ln1(x)), then h + mlp(ln2(h))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.parallel = args.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.attention = attention(args, layer)
        self.mlp = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        attended = self.attention(self.input_layernorm(x), frame, cache)
        if self.parallel:
            return x + attended + self.mlp(self.post_attention_layernorm(x))
        h = x + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    """The embedding, the layers and the final norm under their Hugging Face names
    (embed_in, final_layer_norm), and the RoPE tables."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module
    ) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.final_layer_norm = norm
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    @property
    def embed_tokens(self) -> nn.Module:
        """The embedding, under the name CausalLM and the loader read."""
        return self.embed_in

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.final_layer_norm


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        super().__init__(args, Attention, MLP, DecoderLayer, norm, body=Body)
