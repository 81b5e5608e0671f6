"""Falcon-H1 (TII, 0.5B to 34B; llama.cpp's "falcon-h1" GGUFs): every layer runs Llama's
attention and a Mamba-2 mixer side by side on the same normed input and adds both
outputs to the residual stream, then a SwiGLU feed-forward. Its muP multipliers: the
embeddings times embedding_multiplier, the logits times lm_head_multiplier; the
attention's input times attention_in_multiplier, its keys times key_multiplier, its
output times attention_out_multiplier; the mixer's input times ssm_in_multiplier, the
parts of its input projection (z, x, B, C, dt) each times one of ssm_multipliers (the
"mup vector"), its output times ssm_out_multiplier; the feed-forward's gate and output
times mlp_multipliers. llama.cpp's converter folds them all into the weights, so its
GGUFs load with every multiplier 1 (llmrun/loading/falcon_h1.py).

The mixer is Granite 4.0-H's (granitemoehybrid.Mamba2Mixer: its chunked SSD, the
convolution's and the SSD's state in cache.recurrent) with an inner size of its own
(mamba_d_ssm) and, after the scan, y * silu(z) alone, or with the grouped RMSNorm
before the gate or after it (mamba_rms_norm, mamba_norm_before_gate).

Reference: transformers/models/falcon_h1/modeling_falcon_h1.py. Parameter names are
Hugging Face checkpoint keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError
from llmrun.models import llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    Hybrid,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
)
from llmrun.models.cache import KVCache
from llmrun.models.granitemoehybrid import GatedRMSNorm, Mamba2Mixer, Mamba2Shape, _float

SSM_PARTS = 5  # z, x, B, C, dt: the parts of in_proj's output ssm_multipliers scale


@dataclass
class ModelArgs(llama.ModelArgs):
    mamba_d_ssm: int | None = 1024  # the mixer's inner size; None: mamba_expand * hidden
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    projectors_bias: bool = False  # the mixer's out_proj's
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: list[float] = field(default_factory=lambda: [1.0] * SSM_PARTS)
    mlp_multipliers: list[float] = field(default_factory=lambda: [1.0, 1.0])

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_d_ssm is None:
            self.mamba_d_ssm = self.mamba_expand * self.hidden_size
        if self.mamba_d_head == "auto":
            self.mamba_d_head = self.mamba_d_ssm // self.mamba_n_heads
        if (
            self.mamba_d_head * self.mamba_n_heads != self.mamba_d_ssm
            or self.mamba_n_heads % self.mamba_n_groups
        ):
            raise ModelFormatError(
                f"Mamba-2 heads do not fit: {self.mamba_n_heads} heads of {self.mamba_d_head} "
                f"in an inner size of {self.mamba_d_ssm} (mamba_d_ssm), "
                f"{self.mamba_n_groups} groups"
            )
        if len(self.ssm_multipliers) != SSM_PARTS or len(self.mlp_multipliers) != 2:
            raise ModelFormatError(
                f"ssm_multipliers holds {len(self.ssm_multipliers)} values (z, x, B, C, dt: 5) "
                f"and mlp_multipliers {len(self.mlp_multipliers)} (gate, down: 2)"
            )
        self.time_step_limit = tuple(_float(v) for v in self.time_step_limit)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config, nullable=("mamba_d_ssm",))

    @property
    def attention_layers(self) -> list[int]:
        """Every layer attends (its KV cache layer is its own index)."""
        return list(range(self.num_hidden_layers))

    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_n_groups,
            self.mamba_d_state, self.mamba_d_conv, self.mamba_conv_bias, self.mamba_proj_bias,
            self.rms_norm_eps, self.time_step_limit,
        )  # fmt: skip

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Every layer's Mamba-2 state of one sequence (Mamba2Shape.state_shapes)."""
        shapes = self.mamba_shape().state_shapes()
        return {i: shapes for i in range(self.num_hidden_layers)}

    def mup_vector(self) -> torch.Tensor:
        """The factor of each of in_proj's outputs: its part's entry of ssm_multipliers."""
        group_width = self.mamba_n_groups * self.mamba_d_state
        widths = [self.mamba_d_ssm, self.mamba_d_ssm, group_width, group_width, self.mamba_n_heads]
        # Explicit CPU: models are built under torch.device("meta"), and this buffer is in
        # no checkpoint.
        return torch.cat(
            [
                torch.full((w,), float(m), device="cpu")
                for w, m in zip(widths, self.ssm_multipliers, strict=True)
            ]
        )


class Attention(llama.Attention):
    """Llama's attention with the keys scaled by key_multiplier: as the queries are
    (the same scores; the cache keeps the keys as projected)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.key_multiplier = args.key_multiplier

    def scale_queries(self, q: torch.Tensor, frame: Frame) -> torch.Tensor:
        return q * self.key_multiplier


class MLP(GatedMLP):
    """down(act(gate(x) * gate multiplier) * up(x)) * down multiplier."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.gate_multiplier, self.down_multiplier = args.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x) * self.gate_multiplier
        return self.down_proj(ops.gated(self.act, gate, self.up_proj(x))) * self.down_multiplier


class GatedNorm(GatedRMSNorm):
    """The grouped RMSNorm of y and the gate silu(z): of y * silu(z) (Granite's), or, with
    `before_gate`, of y alone, the gate applied after it."""

    def __init__(self, dim: int, groups: int, eps: float, before_gate: bool) -> None:
        super().__init__(dim, groups, eps)
        self.before_gate = before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self.before_gate:
            return super().forward(y, z)
        grouped = y.float().unflatten(-1, (self.groups, -1))  # [..., D] -> [..., G, D / G]
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * grouped.flatten(-2) * F.silu(z.float())).to(y.dtype)


class Gate(nn.Module):
    """y * silu(z), where the mixer has no norm (mamba_rms_norm false)."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return y * F.silu(z.to(y.dtype))


class Mixer(Mamba2Mixer):
    """Mamba-2 with its input times ssm_in_multiplier, in_proj's parts times the mup
    vector, out_proj's bias from projectors_bias, and its gate and norm (Gate or
    GatedNorm). `layer`: the model's layer index, under which its state is kept."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args.mamba_shape(), layer)
        self.ssm_in_multiplier = args.ssm_in_multiplier
        self.register_buffer("mup_vector", args.mup_vector(), persistent=False)
        self.out_proj = nn.Linear(self.inner, args.hidden_size, bias=args.projectors_bias)
        if args.mamba_rms_norm:
            self.norm = GatedNorm(
                self.inner, self.groups, args.rms_norm_eps, args.mamba_norm_before_gate
            )
        else:
            self.norm = Gate()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x * self.ssm_in_multiplier) * self.mup_vector.to(x.dtype)


class DecoderLayer(nn.Module):
    """x + mamba(h) * ssm_out_multiplier + attn(h * attention_in_multiplier) *
    attention_out_multiplier with h = norm(x), then x + feed_forward(norm(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.mamba = Mixer(args, layer)
        self.self_attn = attention(args, layer)
        self.feed_forward = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ssm_out_multiplier = args.ssm_out_multiplier
        self.attention_in_multiplier = args.attention_in_multiplier
        self.attention_out_multiplier = args.attention_out_multiplier

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.mamba(h, frame, cache) * self.ssm_out_multiplier
        attended = self.self_attn(h * self.attention_in_multiplier, frame, cache)
        x = x + (mixed + attended * self.attention_out_multiplier)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class Body(nn.Module):
    """The embedding, the layers, the final norm under its Hugging Face name
    (final_layernorm) and the RoPE tables."""

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
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.final_layernorm


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.args.embedding_multiplier

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """CausalLM.forward's logits times lm_head_multiplier."""
        logits = super().forward(input_ids, positions, cache, last_only, last, static)
        return logits * self.args.lm_head_multiplier
