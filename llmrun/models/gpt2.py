"""GPT-2 (GPT2LMHeadModel: GPT-2 small to XL, DistilGPT2 and their fine-tunes; llama.cpp's
"gpt2" GGUFs): learned absolute position embeddings added to the token embeddings,
LayerNorms with a bias, one fused c_attn projection whose rows hold all queries, all keys,
all values, biases everywhere, and a feed-forward without a gate, c_proj(gelu_new(c_fc(x))),
in the pre-norm block x + attn(ln_1(x)), then x + mlp(ln_2(x)).

The checkpoints' Conv1D matrices are stored [in, out]; llmrun/loading/gpt2.py transposes
them into nn.Linear's [out, in] and renames transformer.wte, wpe, h.N, ln_f to llmrun's
model.embed_tokens, position_embeddings, layers.N, norm.

Reference: transformers/models/gpt2/modeling_gpt2.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    activation,
    args_from_config,
    attend,
    attend_scaled,
    learned_positions,
)
from llmrun.models.cache import KVCache

# GPT2Config.attribute_map: the checkpoints' field names -> the usual ones.
CONFIG_ALIASES = {
    "n_embd": "hidden_size",
    "n_positions": "max_position_embeddings",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
}


@dataclass
class ModelArgs:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    vocab_size: int = 50257
    max_position_embeddings: int = 1024
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    add_cross_attention: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.add_cross_attention:
            raise UnsupportedError("a GPT-2 model with cross-attention layers is not supported")
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = self.n_inner or 4 * self.hidden_size

    def attention_scale(self, layer: int) -> float | None:
        """The score scale of `layer` where it is not 1/sqrt(head_dim) (None there)."""
        if self.scale_attn_weights and not self.scale_attn_by_inverse_layer_idx:
            return None
        scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        for alias, name in CONFIG_ALIASES.items():
            if alias in config:
                config.setdefault(name, config.pop(alias))
        return args_from_config(cls, config)


class Attention(nn.Module):
    """c_attn's queries, keys and values (each hidden wide), attended, projected by c_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        self.scale = args.attention_scale(layer)
        self.c_attn = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.c_proj = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, 3 * H * D] -> [B, T, 3, H, D] -> three [B, H, T, D]
        qkv = self.c_attn(x).view(batch, tokens, 3, self.n_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        if self.scale is None:
            return self.c_proj(attend(q, k, v, self.layer, frame, cache))
        return self.c_proj(attend_scaled(q, k, v, self.layer, frame, cache, self.scale))


class MLP(nn.Module):
    """c_proj(act(c_fc(x))), both biased."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.c_fc = nn.Linear(args.hidden_size, args.intermediate_size)
        self.c_proj = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class DecoderLayer(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        self.attn = attention(args, layer)
        self.ln_2 = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        self.mlp = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), frame, cache)
        return x + self.mlp(self.ln_2(x))


class Body(nn.Module):
    """The token and position embeddings, the layers and the final LayerNorm. No RoPE:
    an empty table where the frame reads one."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)

    def rotary_emb(
        self, positions: torch.Tensor, capacity: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of no rotation: [B, T, 0]."""
        empty = torch.empty(*positions.shape, 0, device=positions.device)
        return empty, empty


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token embeddings plus the learned embeddings of their positions."""
        return self.model.embed_tokens(input_ids) + self.model.position_embeddings(
            learned_positions(positions, self.args.max_position_embeddings)
        )
