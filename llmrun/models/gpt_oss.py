"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a mixture of experts with biases everywhere (q,
k, v and o, the router, every expert's projections), a clamped SwiGLU with a +1 on the
up branch, attention sinks (a learned logit per head in every softmax's denominator),
sliding-window (128) and full layers in turn, and YaRN RoPE.

Reference: transformers/models/gpt_oss/modeling_gpt_oss.py. transformers holds each
layer's experts fused (experts.gate_up_proj [E, D, 2I] with gate and up interleaved,
experts.down_proj [E, I, D]); llmrun keeps one module per expert, under the names
llama.cpp's split gives them (`mlp.experts.N.gate_proj`, `up_proj`, `down_proj`, each
with its bias), so a loader can hand it any expert's weights as they are stored (the
GGUF's MXFP4 stacks, the Hub's MXFP4 blocks, transformers' fused tensors:
llmrun/loading/gpt_oss.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.models.base import (
    CausalLM,
    Frame,
    LayerTypes,
    args_from_config,
    attend_prompt_rows,
    cached_keys_values,
    check_top_k,
    mix_experts,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache

# transformers' GptOssConfig defaults, for a config that leaves RoPE out.
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")
        # transformers' default layer types: local, global, local, ...
        self.layer_types = windowed_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        if "num_local_experts" not in config and "num_experts" in config:
            config["num_local_experts"] = config["num_experts"]
        if not (config.get("rope_parameters") or config.get("rope_scaling")):
            config["rope_parameters"] = dict(DEFAULT_ROPE)
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        if "rope_theta" not in config and "rope_theta" not in rope:
            config["rope_theta"] = DEFAULT_THETA
        return args_from_config(cls, config)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """softmax over [q k^T * scale + mask, sink] with the sink's share dropped, times v:
    q [B, H, T, D], k/v [B, Hkv, L, D] (grouped-query), mask [B, 1, T, L] (True:
    attend) or None, sinks [H]; returns [B, T, H*D]. A query that sees no key still has
    the sink, so its output is 0, not NaN. One query seeing every key (decode) goes to
    ops.attend_one, which also takes k/v as a KV cache stores them."""
    batch, heads, tokens, head_dim = q.shape
    if tokens == 1 and mask is None:
        return ops.attend_one(q, k, v, scale, sinks=sinks)
    groups, length = k.shape[1], k.shape[2]
    per_group = heads // groups
    # [B, H, T, D] -> [B, Hkv, H/Hkv * T, D]: each KV head serves its query heads.
    grouped = q.reshape(batch, groups, per_group * tokens, head_dim)
    scores = ((grouped @ k.transpose(-1, -2)) * scale).view(
        batch, groups, per_group, tokens, length
    )
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    sink = sinks.to(scores.dtype).view(1, groups, per_group, 1, 1)
    logits = torch.cat([scores, sink.expand(batch, -1, -1, tokens, 1)], dim=-1)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :length].to(v.dtype)
    out = weights.reshape(batch, groups, per_group * tokens, length) @ v
    # [B, Hkv, H/Hkv * T, D] -> [B, T, H*D]
    return out.view(batch, heads, tokens, head_dim).transpose(1, 2).reshape(batch, tokens, -1)


def attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    frame: Frame,
    cache: KVCache | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """sink_attention of q [B, H, T, D] over the cache after storing k/v [B, Hkv, T, D]:
    a prompt's rows through ops.attend_prompt (windows and sinks in the kernel; as
    attend_scaled takes them), anything else through sink_attention; the keys read as stored where either native
    kernel takes them, so the cache is not converted whole. Returns [B, T, H*D]."""
    tokens = q.shape[2]
    prompt = frame.prompt if tokens > 1 else None
    k, v = cached_keys_values(k, v, layer, frame, cache, tokens, bool(prompt))
    if prompt:
        out = attend_prompt_rows(q, k, v, prompt, scale, None, sinks)
        if out is not None:
            return out
        k, v = ops.stored_values(k, q.dtype), ops.stored_values(v, q.dtype)
    return sink_attention(q, k, v, frame.mask, scale, sinks)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.layer_type = args.layer_types[layer]
        self.scale = args.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads))

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        out = attend_with_sinks(q, k, v, self.layer, frame, cache, self.scale, self.sinks)
        return self.o_proj(out)


class Expert(nn.Module):
    """down(glu(gate(x), up(x))) with gpt-oss's clamped SwiGLU (`glu`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, width = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(dim, width, bias=True)
        self.up_proj = nn.Linear(dim, width, bias=True)
        self.down_proj = nn.Linear(width, dim, bias=True)
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
        in transformers' order of operations."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    """The top-k experts of the router's logits (with its bias), weighted by a softmax
    over those k logits."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        top, indices = torch.topk(self.router(x2), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        return mix_experts(x2, weights, indices, self.experts).view(x.shape)


class Model(LayerTypes, CausalLM):
    """CausalLM with HF's module names but for the experts' (see the module's docstring),
    a Frame per layer type."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock)
