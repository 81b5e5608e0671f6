"""HRM-Text (Sapient's hierarchical reasoning model, HrmTextForCausalLM): two stacks of
the same pre-norm Llama layers, a low-level one (L) and a high-level one (H), run in
cycles over one token stream. The embeddings (times embedding_scale) start the high
state, a learned vector z_L_init the low one; each of H_cycles runs the L stack
L_cycles times on low + high, then the H stack once on high + low. The logits are
lm_head(high): each stack ends in its own norm and there is no other.

Every norm is a weightless RMSNorm; attention is multi-head (no GQA) with its output
gated by sigmoid(gate_proj(x)) per channel before o_proj. Every stack invocation keeps
its own keys and values: the KV cache has one entry per layer and invocation,
num_layers_per_stack * H_cycles * (L_cycles + 1) of them, which transformers' config
writes as num_hidden_layers.

Prefix-LM attention (config.prefix_lm) applies only where a caller passes
token_type_ids; generation without them, transformers' included, is causal, as here
and in llama.cpp.

Reference: transformers/models/hrm_text/modular_hrm_text.py (HrmTextForCausalLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RotaryEmbedding,
    args_from_config,
    attend,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    # HrmTextConfig's defaults.
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_hidden_layers: int = 16  # each stack's layers until __post_init__, then cache entries
    num_layers_per_stack: int | None = None
    H_cycles: int = 2
    L_cycles: int = 3
    head_dim: int = 128
    embedding_scale: float | None = None
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # As HrmTextConfig: a config without num_layers_per_stack (the original
        # checkpoints') counts each stack's layers in num_hidden_layers.
        if self.num_layers_per_stack is None:
            self.num_layers_per_stack = self.num_hidden_layers
        for name in ("num_layers_per_stack", "H_cycles", "L_cycles"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ModelFormatError(f"hrm_text {name} is {value!r}, not a positive whole number")
        self.num_hidden_layers = self.num_layers_per_stack * self.H_cycles * (self.L_cycles + 1)
        self.num_key_value_heads = self.num_attention_heads
        if self.embedding_scale is None:
            if self.initializer_range <= 0:
                raise ModelFormatError(
                    f"hrm_text initializer_range is {self.initializer_range} and no "
                    "embedding_scale is given; the default scale is 1 / initializer_range"
                )
            self.embedding_scale = 1.0 / self.initializer_range

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    def entry(self, cycle: int, layer: int) -> int:
        """The KV cache entry of stack layer `layer` in stack invocation `cycle` (h *
        (L_cycles + 1) + l for the L stack's l-th run in high cycle h, l = L_cycles for
        the H stack's run), as transformers places it."""
        return cycle * self.num_layers_per_stack + layer


def norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The weightless RMSNorm, in float32 and cast back."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        width, bias = self.n_heads * self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.o_proj = nn.Linear(width, args.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, entry: int
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q, k, v = (
            p(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = attend(frame.rotate(q), frame.rotate(k), v, entry, frame, cache)
        return self.o_proj(torch.sigmoid(self.gate_proj(x)) * out)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)), both norms weightless."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = GatedMLP(args)
        self.eps = args.rms_norm_eps

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, entry: int
    ) -> torch.Tensor:
        x = x + self.self_attn(norm(x, self.eps), frame, cache, entry)
        return x + self.mlp(norm(x, self.eps))


class Stack(nn.Module):
    """num_layers_per_stack layers, then the weightless final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers_per_stack))

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, cycle: int
    ) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, frame, cache, self.args.entry(cycle, i))
        return norm(x, self.args.rms_norm_eps)


class Body(nn.Module):
    """The embedding, the two stacks, the low state's start and the RoPE tables, under
    transformers' names (CausalLM's body hook: the layer classes it passes are unused)."""

    def __init__(self, args: ModelArgs, *_: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.L_module = Stack(args)
        self.H_module = Stack(args)
        self.z_L_init = nn.Parameter(torch.zeros(args.hidden_size))
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class Model(CausalLM):
    """embed * embedding_scale -> the H/L cycles -> lm_head; CausalLM's frames, static
    decode step and KV cache (one entry per layer and stack invocation)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, body=Body)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (or [B, 1, vocab]: last_only, or `last` [B], each
        row's last real token) of input_ids [B, T] at positions [B, T]; `static`: see
        CausalLM.forward."""
        args, body = self.args, self.model
        high = self.embed(input_ids) * args.embedding_scale
        if static is not None:
            frame = self.static_frame(positions, cache, high.dtype, static)
        else:
            frame = self.frame(positions, cache, high.dtype, last)
        low = body.z_L_init.to(high.dtype).expand_as(high)
        for h in range(args.H_cycles):
            for i in range(args.L_cycles):
                low = body.L_module(low + high, frame, cache, h * (args.L_cycles + 1) + i)
            high = body.H_module(high + low, frame, cache, h * (args.L_cycles + 1) + args.L_cycles)
        if last is not None:
            high = high[torch.arange(high.shape[0], device=high.device), last][:, None]
        elif last_only:
            high = high[:, -1:]
        return self.lm_head(high).float()
