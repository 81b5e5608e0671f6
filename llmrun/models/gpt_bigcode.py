"""GPT-BigCode (StarCoder 1, SantaCoder; llama.cpp's "starcoder" GGUFs): learned
absolute position embeddings added to the token embeddings, no RoPE; attention from one
fused, biased c_attn, multi-query (all queries, then one key head and one value head)
or, without multi_query, each head's query, key and value together; LayerNorms with a
bias and a biased feed-forward without a gate, c_proj(gelu(c_fc(x))).

The checkpoints name the modules transformer.wte, transformer.wpe, transformer.h.N and
transformer.ln_f; the loader renames them to llmrun's (llmrun/loading/gpt_bigcode.py).
The position embedding lives here: no other family of llmrun had one when it was added.

Reference: transformers/models/gpt_bigcode/modeling_gpt_bigcode.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.models.base import (
    CausalLM,
    Frame,
    activation,
    attend_scaled,
    attention_mask,
    key_positions,
    learned_positions,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_positions: int = 1024
    vocab_size: int = 50257
    n_inner: int | None = None
    activation_function: str = "gelu_pytorch_tanh"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    multi_query: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        # The names the rest of llmrun reads (KV cache, loader, server).
        self.hidden_size, self.num_hidden_layers = self.n_embd, self.n_layer
        self.num_attention_heads = self.n_head
        self.num_key_value_heads = 1 if self.multi_query else self.n_head
        self.head_dim = self.n_embd // self.n_head
        self.max_position_embeddings = self.n_positions
        self.intermediate_size = self.n_inner or 4 * self.n_embd
        self.scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = set(cls.__dataclass_fields__)
        values = {k: v for k, v in config.items() if k in names and v is not None}
        # GPTBigCodeConfig's attribute_map names, where a config spells them so.
        aliases = (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
                   ("num_hidden_layers", "n_layer"), ("max_position_embeddings", "n_positions"))  # fmt: skip
        for alias, name in aliases:
            if alias in config:
                values.setdefault(name, config[alias])
        return cls(**values)


class Attention(nn.Module):
    """c_attn split into queries, keys and values, attention at the config's scale, c_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.args = layer, args
        kv_width = args.num_key_value_heads * args.head_dim
        self.c_attn = nn.Linear(args.n_embd, args.n_embd + 2 * kv_width)
        self.c_proj = nn.Linear(args.n_embd, args.n_embd)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        heads, head_dim = self.args.n_head, self.args.head_dim
        qkv = self.c_attn(x)
        if self.args.multi_query:
            # [B, T, H*D + 2*D]: every query head, then the one key and value head.
            q, k, v = qkv.split((heads * head_dim, head_dim, head_dim), dim=-1)
            q = q.view(batch, tokens, heads, head_dim).transpose(1, 2)
            k, v = k[:, None], v[:, None]
        else:
            # [B, T, H, 3*D]: each head's query, key and value side by side.
            per_head = qkv.view(batch, tokens, heads, 3 * head_dim).transpose(1, 2)
            q, k, v = per_head.split(head_dim, dim=-1)
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.args.scale)
        return self.c_proj(out)


class MLP(nn.Module):
    """c_proj(act(c_fc(x))), both biased, no gate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.c_fc = nn.Linear(args.n_embd, args.intermediate_size)
        self.c_proj = nn.Linear(args.intermediate_size, args.n_embd)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class DecoderLayer(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, args.layer_norm_epsilon)
        self.attn = attention(args, layer)
        self.ln_2 = nn.LayerNorm(args.n_embd, args.layer_norm_epsilon)
        self.mlp = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), frame, cache)
        return x + self.mlp(self.ln_2(x))


class Body(nn.Module):
    """The token and position embeddings, the blocks and the final LayerNorm."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.n_embd)
        self.embed_positions = nn.Embedding(args.n_positions, args.n_embd)
        self.layers = nn.ModuleList(layer(args, i, attention, mlp) for i in range(args.n_layer))
        self.norm = nn.LayerNorm(args.n_embd, args.layer_norm_epsilon)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token embeddings plus the learned embeddings of their positions."""
        return self.model.embed_tokens(input_ids) + self.model.embed_positions(
            learned_positions(positions, self.args.n_positions)
        )

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> Frame:
        """The causal mask of these positions, and no RoPE tables (static decode declines
        a model with a frame of its own)."""
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        mask = attention_mask(positions, key_positions(positions, length, cache), None)
        no_rope = positions.new_zeros(0, dtype=dtype)
        return Frame(positions, start, length, mask, no_rope, no_rope)
