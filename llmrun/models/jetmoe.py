"""JetMoE (jetmoe/jetmoe-8b): Llama's pre-norm blocks with a mixture of experts in both
sublayers. Attention is a mixture of attention heads (MoA): a router picks
num_experts_per_tok experts a token, each with its own query projection (num_key_value_heads
heads of kv_channels) and output projection; the keys and values are one shared
projection (kv_proj), every expert's query heads attending to them, so the model has
num_key_value_heads * num_experts_per_tok query heads over num_key_value_heads KV heads.
The expert outputs are summed weighted by the softmax of the chosen router logits, plus a
bias. The feed-forward is a mixture of SwiGLU experts routed the same way, plus a bias.
The decoder layers' norms take eps 1e-6 whatever the config says (transformers'
JetMoeRMSNorm default); the final norm takes rms_norm_eps.

Reference: transformers/models/jetmoe/modeling_jetmoe.py. The Hub's checkpoints hold each
layer's experts stacked ([experts, out, in]: input_linear, output_linear; the
feed-forward's input_linear gate rows, then up rows); llmrun keeps one module per expert
(self_attention.experts.input_linear.N, mlp.experts.N.gate_proj, ...), and
llmrun/loading/jetmoe.py splits the stacks into them (views).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    args_from_config,
    attend,
    check_top_k,
    mix_experts,
)
from llmrun.models.cache import KVCache

LAYER_NORM_EPS = 1e-6  # JetMoeDecoderLayer's norms: JetMoeRMSNorm(hidden_size), no eps given


@dataclass
class ModelArgs:
    # JetMoeConfig's defaults.
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 12
    vocab_size: int = 32000
    num_key_value_heads: int = 16
    kv_channels: int = 128
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    activation_function: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # Derived, under the names llmrun's shared parts read.
    num_attention_heads: int = field(init=False)
    head_dim: int = field(init=False)
    hidden_act: str = field(init=False)

    def __post_init__(self) -> None:
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")
        self.num_attention_heads = self.num_key_value_heads * self.num_experts_per_tok
        self.head_dim = self.kv_channels
        self.hidden_act = self.activation_function

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # num_attention_heads and head_dim follow from the other fields (JetMoeConfig
        # writes the first, maps the second to kv_channels).
        derived = ("num_attention_heads", "head_dim", "hidden_act")
        return args_from_config(cls, {k: v for k, v in config.items() if k not in derived})


class Router(nn.Module):
    """JetMoeTopKGating: the top-k experts of the logits (f32), weighted by the softmax
    of those k logits."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.layer = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [N, k] in x's dtype and expert indices [N, k] of x [N, D]."""
        logits, indices = self.layer(x).float().topk(self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1).type_as(x), indices


def by_expert(indices: torch.Tensor, n_experts: int):
    """For each expert chosen by some token: (expert, the flat (token, slot) positions
    [M] that chose it), in ascending expert order; indices [N, k]."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=n_experts).tolist()):
        if count:
            yield e, order[start : start + count]
            start += count


class MixtureOfAttention(nn.Module):
    """JetMoeMoA: each expert's query projection (input_linear.N) and output projection
    (output_linear.N), the router, and the bias added to the mixed output."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = args.num_key_value_heads * args.head_dim
        self.top_k, self.n_experts = args.num_experts_per_tok, args.num_local_experts
        self.router = Router(args)
        self.input_linear = nn.ModuleList(
            nn.Linear(args.hidden_size, width, bias=False) for _ in range(self.n_experts)
        )
        self.output_linear = nn.ModuleList(
            nn.Linear(width, args.hidden_size, bias=False) for _ in range(self.n_experts)
        )
        self.bias = nn.Parameter(torch.zeros(args.hidden_size))

    def queries(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Each token's query of each of its experts: [N, k, width] of x [N, D]."""
        out = x.new_empty(indices.numel(), self.input_linear[0].out_features)
        for e, slots in by_expert(indices, self.n_experts):
            out[slots] = self.input_linear[e](x[slots // self.top_k])
        return out.view(*indices.shape, -1)

    def mix(self, y: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_j weights[n, j] * output_linear[indices[n, j]](y[n, j]) + bias, of y [N, k,
        width]: each token's expert outputs added in ascending expert order, as
        transformers adds them."""
        flat, gates = y.reshape(-1, y.shape[-1]), weights.reshape(-1, 1)
        out = y.new_zeros(y.shape[0], self.bias.shape[0])
        for e, slots in by_expert(indices, self.n_experts):
            out.index_add_(
                0, slots // self.top_k, self.output_linear[e](flat[slots]) * gates[slots]
            )
        return out + self.bias


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.top_k = layer, args.num_experts_per_tok
        self.n_kv_heads, self.head_dim = args.num_key_value_heads, args.head_dim
        self.experts = MixtureOfAttention(args)
        self.kv_proj = nn.Linear(args.hidden_size, 2 * self.n_kv_heads * self.head_dim, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        k_slots, kv_heads, dim = self.top_k, self.n_kv_heads, self.head_dim
        x2 = x.reshape(batch * tokens, -1)
        weights, indices = self.experts.router(x2)
        # transformers repeats the KV heads once per expert slot (query head j * Hkv + h
        # reads KV head h); grouped by KV head instead (h * k + j), as attend()'s GQA reads.
        # [B*T, k, Hkv*D] -> [B, T, k, Hkv, D] -> [B, Hkv * k, T, D]
        q = self.experts.queries(x2, indices).view(batch, tokens, k_slots, kv_heads, dim)
        q = q.transpose(2, 3).reshape(batch, tokens, kv_heads * k_slots, dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(batch, tokens, 2, kv_heads, dim).unbind(2)
        out = attend(frame.rotate(q), frame.rotate(k.transpose(1, 2)), v.transpose(1, 2),
                     self.layer, frame, cache)  # fmt: skip
        # [B, T, Hkv * k * D] -> [B*T, k, Hkv*D], each expert slot's heads together
        out = out.view(batch * tokens, kv_heads, k_slots, dim).transpose(1, 2)
        out = self.experts.mix(out.reshape(batch * tokens, k_slots, -1), weights, indices)
        return out.view(x.shape)


class SparseMoeBlock(nn.Module):
    """JetMoeMoE: the router's top-k SwiGLU experts, weighted by the softmax of their
    logits, plus a bias."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.router = Router(args)
        self.experts = nn.ModuleList(GatedMLP(args) for _ in range(args.num_local_experts))
        self.bias = nn.Parameter(torch.zeros(args.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.router(x2)
        return (mix_experts(x2, weights, indices, self.experts) + self.bias).view(x.shape)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + moe(norm(x)); the attention under transformers' name
    self_attention."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attention = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, LAYER_NORM_EPS)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)
