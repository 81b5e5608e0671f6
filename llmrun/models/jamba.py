"""AI21 Jamba (Jamba-v0.1, Jamba 1.5 Mini/Large, Jamba Reasoning): Mamba-1 layers among
attention layers (one in attn_layer_period, at attn_layer_offset), each layer's
feed-forward a mixture of experts (one in expert_layer_period, at expert_layer_offset:
the top num_experts_per_tok of the router's softmax, not renormalized) or a dense SwiGLU.
Each layer is x + mixer(input_layernorm(x)), then x + feed_forward(pre_ff_layernorm(x)).
The attention has no position encoding; the Mamba mixer is mamba.MambaMixer with RMS
norms (with weights) of its time step, B and C.

Reference: transformers/models/jamba/modeling_jamba.py. Parameter names are its
checkpoint keys (experts one module each: llmrun/loading/jamba.py splits transformers
5's stacks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import llama, qwen3_moe
from llmrun.models.base import (
    CausalLM,
    Frame,
    Hybrid,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    mix_experts,
    route,
)
from llmrun.models.cache import KVCache
from llmrun.models.mamba import MambaMixer, MixerShape

LAYER_TYPES = ("attention", "mamba")


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    num_experts: int = 16
    num_experts_per_tok: int = 2
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    attn_layer_period: int = 8
    attn_layer_offset: int = 4
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    max_position_embeddings: int = 262_144
    tie_word_embeddings: bool = False
    # Each layer's mixer and whether its feed-forward has experts, where a GGUF lists them
    # (llmrun/loading/jamba.py); else from the periods and offsets, as JambaConfig does.
    layer_types: list[str] | None = None
    expert_layers: list[int] | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no RoPE
    attention_bias: bool = False  # llama.Attention reads it

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        if self.mamba_dt_rank == "auto":
            self.mamba_dt_rank = math.ceil(self.hidden_size / 16)
        layers = range(self.num_hidden_layers)
        if self.layer_types is None:
            period, offset = self.attn_layer_period, self.attn_layer_offset
            self.layer_types = ["attention" if i % period == offset else "mamba" for i in layers]
        if self.expert_layers is None:
            period, offset = self.expert_layer_period, self.expert_layer_offset
            every = self.num_experts > 1
            self.expert_layers = [i for i in layers if every and i % period == offset]
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedError(f"Jamba layer types {unknown} are not supported")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"Jamba's layer pattern lists {len(self.layer_types)} layers, but "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        if self.hidden_act != "silu":
            raise UnsupportedError(
                f"Jamba with hidden_act {self.hidden_act!r} is not supported (silu only, "
                "as its checkpoints and llama.cpp have it)"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def attention_layers(self) -> list[int]:
        """The attention layers' indices; the KV cache holds these alone, in order."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "attention"]

    def mixer_shape(self) -> MixerShape:
        return MixerShape(
            self.hidden_size, self.mamba_expand * self.hidden_size, self.mamba_d_state,
            self.mamba_d_conv, self.mamba_dt_rank, self.mamba_proj_bias, self.mamba_conv_bias,
        )  # fmt: skip

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each Mamba layer's state of one sequence (mamba.ModelArgs.recurrent_shapes)."""
        inner = self.mamba_expand * self.hidden_size
        return {
            i: [(inner, self.mamba_d_conv - 1), (inner, self.mamba_d_state)]
            for i, kind in enumerate(self.layer_types)
            if kind == "mamba"
        }

    def layer_windows(self) -> list[None]:
        """Each cached (attention) layer's window: none."""
        return [None] * len(self.attention_layers)


class Attention(llama.Attention):
    """Grouped-query attention without position encoding, scaled by head_dim^-0.5."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.attention_layers.index(layer))

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return x


class JambaMambaMixer(MambaMixer):
    """The Mamba-1 mixer with RMS norms (with weights) of its time step, B and C."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args.mixer_shape(), layer)
        self.dt_layernorm = RMSNorm(args.mamba_dt_rank, args.rms_norm_eps)
        self.b_layernorm = RMSNorm(args.mamba_d_state, args.rms_norm_eps)
        self.c_layernorm = RMSNorm(args.mamba_d_state, args.rms_norm_eps)

    def normalize(
        self, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)


class SparseMoeBlock(nn.Module):
    """The top-k experts of the router's softmax, their weights not renormalized."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            qwen3_moe.MLP(args, args.intermediate_size) for _ in range(args.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = route(self.router(x2), self.top_k, normalize=False)
        return mix_experts(x2, weights, indices, self.experts).view(x.shape)


class DecoderLayer(nn.Module):
    """x + mixer(input_layernorm(x)), then x + feed_forward(pre_ff_layernorm(x)); the mixer
    is the layer type's (self_attn or mamba)."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        if args.layer_types[layer] == "attention":
            self.self_attn = attention(args, layer)
        else:
            self.mamba = JambaMambaMixer(args, layer)
        if layer in args.expert_layers:
            self.feed_forward = SparseMoeBlock(args)
        else:
            self.feed_forward = mlp(args, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        mixer = self.mamba if hasattr(self, "mamba") else self.self_attn
        x = x + mixer(self.input_layernorm(x), frame, cache)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class Body(nn.Module):
    """The embedding, the layers, the final norm under its Hugging Face name
    (final_layernorm) and RoPE tables the attention does not use (CausalLM's frame
    computes them)."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            {"rope_type": "default", "rope_theta": 10000.0},
            args.head_dim,
            args.max_position_embeddings,
        )

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.final_layernorm


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, qwen3_moe.MLP, DecoderLayer, body=Body)
