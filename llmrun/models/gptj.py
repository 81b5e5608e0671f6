"""GPT-J (GPTJForCausalLM: GPT-J-6B and its fine-tunes): the parallel block
x + attn(ln_1(x)) + mlp(ln_1(x)) from one LayerNorm (with a bias), unbiased q, k, v and
out projections, RoPE on adjacent pairs (x[2i], x[2i+1]) of each head's first rotary_dim
features (base 10000), a biased GELU feed-forward fc_out(gelu_new(fc_in(x))) without a
gate, and a biased lm_head.

The checkpoints name the modules transformer.wte, transformer.h.N, transformer.ln_f;
llmrun/loading/gpt2.py renames them to llmrun's, as it does GPT-2's.

Reference: transformers/models/gptj/modeling_gptj.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import CausalLM, Frame, activation, args_from_config, attend, rotate_pairs
from llmrun.models.cache import KVCache
from llmrun.models.gpt2 import CONFIG_ALIASES

ROPE_THETA = 10000.0  # create_sinusoidal_positions' base: no config field sets it


@dataclass
class ModelArgs:
    hidden_size: int = 4096
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    vocab_size: int = 50400
    max_position_embeddings: int = 2048
    rotary_dim: int | None = 64
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = self.n_inner or 4 * self.hidden_size
        # transformers turns every head by tables of the hidden size without rotary_dim
        # (only one head's width fits): no model to follow.
        if self.rotary_dim is None or not 0 < self.rotary_dim <= self.head_dim:
            raise UnsupportedError(
                f"a GPT-J model with rotary_dim {self.rotary_dim} (heads of {self.head_dim} "
                "features) is not supported"
            )
        self.rope_parameters = {
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        for alias, name in CONFIG_ALIASES.items():
            if alias in config:
                config.setdefault(name, config.pop(alias))
        return args_from_config(cls, config, nullable=("rotary_dim",))


class Attention(nn.Module):
    """Unbiased q, k, v; queries and keys turned on adjacent pairs; out_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.out_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
            return t.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)

        q = rotate_pairs(heads(self.q_proj(x)), frame)
        k = rotate_pairs(heads(self.k_proj(x)), frame)
        return self.out_proj(attend(q, k, heads(self.v_proj(x)), self.layer, frame, cache))


class MLP(nn.Module):
    """fc_out(act(fc_in(x))), both biased."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.fc_in = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc_out = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class DecoderLayer(nn.Module):
    """x + attn(ln_1(x)) + mlp(ln_1(x)): one LayerNorm feeds both branches."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        self.attn = attention(args, layer)
        self.mlp = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        normed = self.ln_1(x)
        return x + self.attn(normed, frame, cache) + self.mlp(normed)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        super().__init__(args, Attention, MLP, DecoderLayer, norm)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size)  # biased, unlike most
