"""ModernBERT encoders (ModernBertModel: answerdotai/ModernBERT, gte-modernbert,
modernbert-embed, granite-embedding-r2; llama.cpp's "modern-bert" GGUFs): token
embeddings normalized, then pre-norm blocks x + attn(attn_norm(x)), x + mlp(mlp_norm(x))
(the first layer's attn_norm the identity), a final norm; one fused Wqkv, RoPE (half-split)
with a base of its own for the global and the local layers, bidirectional attention, the
local layers' to keys within local_attention / 2 positions either way, padded keys masked;
a gated feed-forward Wo(act(input) * gate) of Wi's two halves. LayerNorms and linears
without biases unless the config says. No head: an embedding model (`hidden_states`).

Reference: transformers/models/modernbert/modeling_modernbert.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.errors import UnsupportedError
from llmrun.models.base import RotaryEmbedding, activation, check_layer_types
from llmrun.models.bert import encoder_attention, key_padding_mask

# ModernBertConfig's default_theta: each layer type's RoPE base where a config names none.
DEFAULT_THETAS = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}


@dataclass
class ModelArgs:
    hidden_size: int = 768
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    intermediate_size: int = 1152
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    vocab_size: int = 50368
    local_attention: int = 128
    global_attn_every_n_layers: int = 3
    layer_types: list[str] | None = None
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            every = self.global_attn_every_n_layers
            self.layer_types = [
                "sliding_attention" if i % every else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)

    @property
    def window(self) -> int:
        """How far a local layer's query sees, either way (transformers' sliding_window)."""
        return self.local_attention // 2

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        values["rope_parameters"] = _rope_parameters(config)
        return cls(**values)


def _rope_parameters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE (transformers 5's rope_parameters by layer type, or older
    files' global_rope_theta and local_rope_theta); scaled RoPE is refused."""
    given = config.get("rope_parameters") or {}
    old = {
        "full_attention": config.get("global_rope_theta"),
        "sliding_attention": config.get("local_rope_theta"),
    }
    out = {}
    for kind, default in DEFAULT_THETAS.items():
        params = dict(given.get(kind) or {})
        kind_type = params.get("rope_type", "default")
        if kind_type != "default" or config.get("rope_scaling"):
            raise UnsupportedError(
                f"modernbert RoPE type {kind_type!r} is not supported (supported: 'default')"
            )
        theta = params.get("rope_theta") or old[kind] or default
        out[kind] = {"rope_type": "default", "rope_theta": theta}
    return out


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.norm = nn.LayerNorm(args.hidden_size, args.norm_eps, bias=args.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.Wqkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=args.attention_bias)
        self.Wo = nn.Linear(args.hidden_size, args.hidden_size, bias=args.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, 3 * H * D] -> [B, T, 3, H, D] -> three [B, H, T, D]
        qkv = self.Wqkv(x).view(batch, tokens, 3, self.n_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        cos, sin = rope
        q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
        return self.Wo(encoder_attention(q, k, v, mask))


class MLP(nn.Module):
    """Wo(act(input) * gate), input and gate Wi's first and second halves."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.Wi = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.Wo = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.act = activation(args.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(ops.gated(self.act, value, gate))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.kind = args.layer_types[layer]
        # The first layer's input is the embeddings' norm already.
        self.attn_norm = (
            nn.LayerNorm(args.hidden_size, args.norm_eps, bias=args.norm_bias)
            if layer
            else nn.Identity()
        )
        self.attn = Attention(args)
        self.mlp_norm = nn.LayerNorm(args.hidden_size, args.norm_eps, bias=args.norm_bias)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask, rope)
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    """The encoder under ModernBertModel's module names (embeddings., layers.N., final_norm)."""

    generates = False  # no LM head: an embedding model (llmrun embed)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.layers = nn.ModuleList(Layer(args, i) for i in range(args.num_hidden_layers))
        self.final_norm = nn.LayerNorm(args.hidden_size, args.norm_eps, bias=args.norm_bias)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(params, args.head_dim, args.max_position_embeddings)
                for kind, params in args.rope_parameters.items()
            }
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Float32 last hidden states [B, T, hidden] (after the final norm) of input_ids
        [B, T] at positions [B, T], each row's first lengths[b] tokens real (padding after
        them is never attended to)."""
        x = self.embeddings(input_ids)
        padding = key_padding_mask(lengths, input_ids.shape[1])
        # [B, T, T] -> [B, 1, T, T]: keys within the window either way of each query
        near = (positions[:, :, None] - positions[:, None, :]).abs() <= self.args.window
        local = near[:, None] if padding is None else near[:, None] & padding
        masks = {"full_attention": padding, "sliding_attention": local}
        ropes = {}
        for kind, rotary in self.rotary.items():
            cos, sin = rotary(positions)
            # [B, T, D] -> [B, 1, T, D], broadcast over heads
            ropes[kind] = (cos[:, None].to(x.dtype), sin[:, None].to(x.dtype))
        for layer in self.layers:
            x = layer(x, masks[layer.kind], ropes[layer.kind])
        return self.final_norm(x).float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings contract's name for forward()."""
        return self(input_ids, positions, lengths)
