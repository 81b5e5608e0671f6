"""Nemotron-NAS (NVIDIA's Llama-3.1-Nemotron-51B, Llama-3.3-Nemotron-Super-49B v1 and
v1.5, Llama-3.1-Nemotron-Ultra-253B; DeciLMForCausalLM, model_type "nemotron-nas";
llama.cpp's "deci" GGUFs): Llama whose layers differ, each as its block_configs entry
says (llmrun/models/deci_config.py). A layer's attention is Llama's with KV heads of its
own, a linear map of the normalized input (self_attn.linear_attn) or nothing; its
feed-forward is Llama's SwiGLU of a width of its own, a linear map (mlp.linear_mlp) or
nothing; a skipped block has no norm either. RoPE is Llama's (llama3 scaling in the
released models).

Only the layers with attention cache keys and values, each with its own KV heads.

Reference: the checkpoints' remote code, modeling_decilm.py (DeciLMDecoderLayer,
DeciLMLinearAttention, DeciLMLinearMLP), built of transformers' Llama modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models import deci_config, llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, RMSNorm, args_from_config
from llmrun.models.cache import KVCache
from llmrun.models.deci_config import ATTENTION, LINEAR, NONE


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    block_configs: list[dict[str, Any]]
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        config = {
            "block_configs": self.block_configs,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "hidden_size": self.hidden_size,
            "head_dim": self.head_dim,
        }
        self.blocks = deci_config.blocks(config)
        self.head_dim = deci_config.head_dim(config)
        self.attention_layers = [i for i, b in enumerate(self.blocks) if b.attention == ATTENTION]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    def layer_args(self, layer: int) -> llama.ModelArgs:
        """Llama's args of one layer: its KV heads and feed-forward width."""
        block = self.blocks[layer]
        return llama.ModelArgs(
            hidden_size=self.hidden_size,
            intermediate_size=block.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            vocab_size=self.vocab_size,
            num_key_value_heads=block.kv_heads or None,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
        )

    def cache_shapes(self) -> list[tuple[int, int]]:
        """Each attention layer's cached (KV heads, head width), in order."""
        return [(self.blocks[i].kv_heads, self.head_dim) for i in self.attention_layers]

    def layer_windows(self) -> list[int | None]:
        """One entry per cached layer: none has a sliding window."""
        return [None] * len(self.attention_layers)


class Attention(llama.Attention):
    """Llama's attention with the layer's KV heads, in the cache's layer of its own."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args.layer_args(layer), args.attention_layers.index(layer))


class LinearAttention(nn.Module):
    """A block whose attention was replaced by a linear map of its normalized input."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    """A block whose feed-forward was replaced by a linear map."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_mlp(x)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)), each sublayer (with its norm) left out
    where its block is a no_op."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        block = self.block = args.blocks[layer]
        if block.attention != NONE:
            self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            linear = block.attention == LINEAR
            self.self_attn = LinearAttention(args) if linear else attention(args, layer)
        if block.ffn != NONE:
            self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            linear = block.ffn == LINEAR
            self.mlp = LinearMLP(args) if linear else mlp(args.layer_args(layer))

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        if self.block.attention != NONE:
            x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        if self.block.ffn != NONE:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, layer=DecoderLayer)

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """A KV cache of the attention layers alone, each with its own KV heads."""
        args = self.args
        shapes = args.cache_shapes()
        heads = shapes[0][0] if shapes else 1
        return KVCache(
            len(shapes), batch, heads, max_seq_len, args.head_dim, dtype, device, shapes=shapes
        )
