"""Muse Spark's language model (Meta's Muse-Spark-Open-816B-A42B): Muse Glimmer's
(llmrun.models.muse_glimmer: normed embeddings, NoPE global layers among rotating sliding
ones, weightless q/k norms, gated attention, scaled and soft-capped logits) with

- each attention head's output through a weightless RMSNorm before the gate;
- a weightless norm after attention, an input-scaled one after the feed-forward
  (norm(x * (1 + w))), and a learned residual gate after each (alpha * residual +
  beta * x, beta = sigmoid(g / T), alpha = sqrt(max(sigmoid(-g / T) * (1 + beta), 1e-3)));
- dense or sparse feed-forwards by mlp_layer_types. The sparse one pools the hidden
  state down to moe_hidden_size (then a centered norm) and back up after the experts;
  the router (float32, on the unpooled state) scores by sigmoid(output_multiplier *
  logit), chooses by score + e_score_correction_bias and weighs the chosen by their
  scores renormalized, times routed_scaling_factor; each expert is a SwiGLU whose output
  goes through one input-scaled norm all the experts share.

Reference: transformers/models/muse_spark/modeling_muse_spark.py (MuseSparkTextModel,
MuseSparkForConditionalGeneration's head).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import muse_glimmer
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    GemmaRMSNorm,
    mix_experts,
    route_grouped,
)
from llmrun.models.cache import KVCache
from llmrun.models.muse_glimmer import unit_rms

MLP_KINDS = ("dense", "sparse")
GATE_EPS = 1e-3  # MuseSparkResidualGate's residual_gate_eps


@dataclass
class ModelArgs(muse_glimmer.ModelArgs):
    # MuseSparkTextConfig's defaults where they differ from Muse Glimmer's.
    intermediate_size: int = 16384
    num_key_value_heads: int = 16
    head_dim: int = 64
    max_position_embeddings: int = 1048576
    qk_scale_factor: float = 5.4730064863875
    output_multiplier: float = 0.1767766952966369
    moe_intermediate_size: int = 4096
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 1.0
    moe_hidden_size: int = 4096
    mlp_layer_types: list[str] | None = None
    residual_gate_temperature: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.num_hidden_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["sparse"] * layers
        unknown = sorted(set(self.mlp_layer_types) - set(MLP_KINDS))
        if unknown:
            raise UnsupportedError(
                f"Muse Spark mlp_layer_types {unknown} are not supported ({', '.join(MLP_KINDS)})"
            )
        if len(self.mlp_layer_types) != layers:
            raise ModelFormatError(
                f"Muse Spark's mlp_layer_types lists {len(self.mlp_layer_types)} layers, "
                f"but the model has {layers}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ModelFormatError(
                f"Muse Spark's num_experts_per_tok {self.num_experts_per_tok} is not within "
                f"its {self.num_local_experts} experts"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # MuseSparkTextConfig names the activation hidden_act (Muse Glimmer's
        # hidden_activation) and turns by 500000 where the file gives no theta.
        config = {**config, "hidden_activation": config.get("hidden_act") or "silu"}
        if not config.get("rope_parameters") and "rope_theta" not in config:
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
        return super().from_config(config)


class InputScaledRMSNorm(nn.Module):
    """x * (1 + w), rounded to x's dtype, then a weightless RMSNorm: the norm after the
    feed-forward and after each expert (transformers' MuseSparkTextInputScaledRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = (x.float() * (1.0 + self.weight.float())).type_as(x)
        return unit_rms(scaled, self.eps)


class ResidualGate(nn.Module):
    """alpha * residual + beta * x, per channel, in float32 (transformers keeps the gate
    in float32 whatever the model's dtype)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.temperature = args.residual_gate_temperature
        self.gate = nn.Parameter(torch.zeros(args.hidden_size))

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        w = self.gate.float() / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=GATE_EPS))
        return (alpha * residual + beta * x).to(residual.dtype)


class Attention(muse_glimmer.Attention):
    """Muse Glimmer's, each head's output through a weightless RMSNorm before the gate."""

    def heads_out(self, out: torch.Tensor) -> torch.Tensor:
        # [B, T, H*D] -> [B, T, H, D]: each head normed on its own, -> [B, T, H*D]
        heads = out.view(*out.shape[:-1], self.n_heads, self.head_dim)
        return unit_rms(heads, self.eps).flatten(-2)


class Router(nn.Module):
    """The experts of each token and their weights (transformers' MuseSparkTopkRouter)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.scale = args.num_experts_per_tok, args.routed_scaling_factor
        self.multiplier = args.output_multiplier
        self.weight = nn.Parameter(torch.zeros(args.num_local_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_local_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x.float(), self.weight.float()) * self.multiplier
        bias = self.e_score_correction_bias.float()
        return route_grouped(logits, self.top_k, "sigmoid", bias, normalize=True, scale=self.scale)


class Experts(nn.Module):
    """The experts (experts.N, SwiGLU at moe_hidden_size; the loader splits the
    checkpoint's stacks into them) and the norm all their outputs go through. Indexing
    gives an expert with that norm after it, as mix_experts calls them."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = SimpleNamespace(
            hidden_size=args.moe_hidden_size,
            intermediate_size=args.moe_intermediate_size,
            hidden_act=args.hidden_act,
        )
        self.count = args.num_local_experts
        for e in range(self.count):
            self.add_module(str(e), GatedMLP(width))
        self.post_expert_norm = InputScaledRMSNorm(args.moe_hidden_size, args.post_norm_eps)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, e: int):
        expert = self._modules[str(e)]
        return lambda x: self.post_expert_norm(expert(x))


class SparseMoeBlock(nn.Module):
    """post_expert_proj(experts(pre_expert_norm(pre_expert_proj(x)))), the experts chosen
    on x itself."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = Router(args)
        self.pre_expert_proj = nn.Linear(args.hidden_size, args.moe_hidden_size, bias=False)
        self.pre_expert_norm = GemmaRMSNorm(args.moe_hidden_size, args.rms_norm_eps)
        self.experts = Experts(args)
        self.post_expert_proj = nn.Linear(args.moe_hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.gate(flat)
        pooled = self.pre_expert_norm(self.pre_expert_proj(flat))
        mixed = mix_experts(pooled, weights.to(x.dtype), indices, self.experts)
        return self.post_expert_proj(mixed).view(x.shape)


def feed_forward(args: ModelArgs, layer: int) -> nn.Module:
    """The layer's feed-forward: a SwiGLU ("dense") or the experts ("sparse")."""
    return SparseMoeBlock(args) if args.mlp_layer_types[layer] == "sparse" else GatedMLP(args)


class Layer(nn.Module):
    """gate(x, post_attention_norm(attn(input_norm(x)))), then
    gate(x, post_feedforward_norm(mlp(pre_feedforward_norm(x))))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: Any) -> None:
        super().__init__()
        dim, eps, post_eps = args.hidden_size, args.rms_norm_eps, args.post_norm_eps
        self.post_eps = post_eps
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args, layer)
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = InputScaledRMSNorm(dim, post_eps)
        self.post_attention_residual_gate = ResidualGate(args)
        self.post_feedforward_residual_gate = ResidualGate(args)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), frames, cache)
        x = self.post_attention_residual_gate(x, unit_rms(attended, self.post_eps))
        fed = self.mlp(self.pre_feedforward_layernorm(x))
        return self.post_feedforward_residual_gate(x, self.post_feedforward_layernorm(fed))


class Model(muse_glimmer.Model):
    def __init__(self, args: ModelArgs) -> None:
        CausalLM.__init__(self, args, Attention, feed_forward, Layer)
