"""LongCat-Flash (Meituan's meituan-longcat/LongCat-Flash-Chat, HF `longcat_flash`):
DeepSeek-V3's multi-head latent attention (always with the query bottleneck; adjacent-pair
RoPE; the cached latent) in a layer of its own shape. Each of num_layers layers holds two
attention blocks and two dense SwiGLU feed-forwards, one after the other, and a mixture of
experts fed by the first feed-forward's input ("shortcut-connected MoE") whose output
joins the layer's residual at its very end. The router scores the n_routed_experts plus
zero_expert_num "zero-computation" experts by softmax, chooses moe_topk of them by score
plus e_score_correction_bias, and weighs each by its score times routed_scaling_factor
(no renormalization); a zero-computation expert returns the token itself. The query and
key latents are scaled after their norms by sqrt(hidden_size / rank) of their bottleneck.

The KV cache counts attention blocks, two a layer: block j of layer i is cache layer
2i + j (transformers' layer_idx too); num_hidden_layers is their number.

Reference: transformers/models/longcat_flash/modular_longcat_flash.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    mix_experts,
    route_grouped,
)
from llmrun.models.cache import KVCache
from llmrun.models.qwen3_moe import MLP

# LongcatFlashConfig's RoPE base where a config.json gives none.
DEFAULT_THETA = 10000000.0
# config.json names -> the DeepSeek names the shared attention and experts read.
RENAMED = {
    "ffn_hidden_size": "intermediate_size",
    "expert_ffn_hidden_size": "moe_intermediate_size",
    "moe_topk": "num_experts_per_tok",
}


@dataclass
class ModelArgs(deepseek_v2.ModelArgs):
    # LongcatFlashConfig's defaults, under DeepSeek's names (RENAMED).
    num_layers: int = 28
    num_experts_per_tok: int = 12
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 512
    zero_expert_num: int = 256
    routed_scaling_factor: float = 6.0
    q_lora_rank: int = 1536
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    router_bias: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.num_layers, int) and self.num_layers > 0):
            raise ModelFormatError(
                f"num_layers is {self.num_layers!r}, not a positive whole number"
            )
        for name in ("q_lora_rank", "kv_lora_rank"):
            rank = getattr(self, name)
            if not (isinstance(rank, int) and rank > 0):
                raise ModelFormatError(f"{name} is {rank!r}, not a positive whole number")
        if self.router_bias:
            raise UnsupportedError("LongCat-Flash with router_bias=true is not supported")
        if "partial_rotary_factor" in self.rope_parameters:
            raise UnsupportedError("LongCat-Flash with partial_rotary_factor is not supported")
        choices = self.n_routed_experts + self.zero_expert_num
        if not 0 < self.num_experts_per_tok <= choices:
            raise ModelFormatError(
                f"moe_topk is {self.num_experts_per_tok}, but a token can choose among "
                f"{choices} experts (n_routed_experts + zero_expert_num)"
            )

    @property
    def latent_scales(self) -> tuple[float, float]:
        """The factors on the normalized query and key latents."""
        return (
            (self.hidden_size / self.q_lora_rank) ** 0.5,
            (self.hidden_size / self.kv_lora_rank) ** 0.5,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = {RENAMED.get(k, k): v for k, v in config.items()}
        layers = config.get("num_layers")
        if layers is None:  # LongcatFlashConfig's num_hidden_layers counts attention blocks
            blocks = config.get("num_hidden_layers")
            layers = blocks // 2 if isinstance(blocks, int) else cls.num_layers
        config.update(num_layers=layers, num_hidden_layers=2 * layers)
        config.setdefault("rope_theta", DEFAULT_THETA)  # under any rope_parameters' own
        return args_from_config(cls, config)


class ScaledRMSNorm(RMSNorm):
    """RMSNorm times a constant (LongCat-Flash's latent scales)."""

    def __init__(self, dim: int, eps: float, scale: float) -> None:
        super().__init__(dim, eps)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class Attention(deepseek_v2.Attention):
    """DeepSeek's latent attention, its latents scaled after their norms: the query's
    before q_b_proj (which has no bias, so every query feature is scaled), the key's
    before it is cached (so the values the latent expands to are scaled alike)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        q_scale, kv_scale = args.latent_scales
        eps = args.latent_norm_eps
        self.q_a_layernorm = ScaledRMSNorm(args.q_lora_rank, eps, q_scale)
        self.kv_a_layernorm = ScaledRMSNorm(args.kv_lora_rank, eps, kv_scale)


class Router(nn.Module):
    """Softmax scores over the routed and zero-computation experts, in f32; the top k by
    score + e_score_correction_bias, each weighing its score times routed_scaling_factor."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        choices = args.n_routed_experts + args.zero_expert_num
        self.classifier = nn.Linear(args.hidden_size, choices, bias=False)
        self.classifier.read_as_floats = True  # its f32 product is the router's own
        self.e_score_correction_bias = nn.Parameter(torch.zeros(choices))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, top_k] in x's dtype and expert indices [N, top_k]."""
        logits = F.linear(x.float(), self.classifier.weight.float())
        weights, indices = route_grouped(
            logits,
            self.args.num_experts_per_tok,
            bias=self.e_score_correction_bias.float(),
            scale=self.args.routed_scaling_factor,
        )
        return weights.to(x.dtype), indices


class MoE(nn.Module):
    """The routed experts; a chosen zero-computation expert adds the token times its weight."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.n_routed = args.n_routed_experts
        self.router = Router(args)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.n_routed_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.router(x2)
        zero = indices >= self.n_routed
        routed = weights.masked_fill(zero, 0.0)
        out = x2 * (weights - routed).sum(dim=-1, keepdim=True)
        if x2.shape[0] == 1:  # decoding: only the chosen routed experts run
            kept = ~zero[0]
            if not kept.any():
                return out.view(x.shape)
            indices, routed = indices[:, kept], routed[:, kept]
        else:  # a zero-computation slot runs expert 0 with weight 0: one shape for all rows
            indices = indices.masked_fill(zero, 0)
        return (out + mix_experts(x2, routed, indices, self.experts)).view(x.shape)


class Layer(nn.Module):
    """attention, feed-forward, attention, feed-forward (pre-norm residual blocks), plus
    the experts' output on the first feed-forward's normalized input, added last."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.mlp = MoE(args)
        self.self_attn = nn.ModuleList(Attention(args, 2 * layer + i) for i in range(2))
        self.mlps = nn.ModuleList(GatedMLP(args) for _ in range(2))
        eps = args.rms_norm_eps
        self.input_layernorm = nn.ModuleList(RMSNorm(args.hidden_size, eps) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(
            RMSNorm(args.hidden_size, eps) for _ in range(2)
        )

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn[0](self.input_layernorm[0](x), frame, cache)
        h = self.post_attention_layernorm[0](x)
        shortcut = self.mlp(h)
        x = x + self.mlps[0](h)
        x = x + self.self_attn[1](self.input_layernorm[1](x), frame, cache)
        return x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut


class Body(nn.Module):
    """The embedding, num_layers layers, the final norm and the RoPE tables."""

    def __init__(self, args: ModelArgs, *_: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, body=Body)
