"""Doge (SmallDoge/Doge-20M .. 320M and their -Instruct): Llama with q/k norms, learned
residual scales, dynamic mask attention and, where is_moe, a cross-domain mixture of
experts (CDMoE).

Dynamic mask attention: each cached value row gives every KV head a bias on its key,
exp(A * softplus(dt_proj(values))), added to the attention scores (repeated to the query
heads); past `keep_window_size` keys, a query keeps only the keep_window_size keys it sees
with the largest bias. CDMoE: a gated MLP plus product-key experts, each a row of
down_embed and of up_embed: the router's two halves of num_experts^0.5 logits score the
experts as sums of one logit of each, the top num_experts_per_tok weighing act(down . x)
* up by their softmax. As transformers does (and the checkpoints were trained so), the
router's [tokens, 2 halves] logits of one forward are read as [2 halves, tokens]: a
prompt's tokens are routed by their neighbours' logits, a decoded token by its own. llmrun
does so per sequence, its padding left out (transformers across its batch), so a prompt's
routing is transformers' where it is prefilled in one forward (`run` prefills 512 tokens
at a time, serve 256).

The Hub's configs scale RoPE "dynamic" (NTK): plain RoPE within max_position_embeddings,
which llmrun runs, and positions past it refused, as for InternLM (llmrun.models.internlm2).

Reference: transformers/models/doge/modular_doge.py. llama.cpp has no converter for it:
HF folders only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models import internlm2, llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    activation,
    attention,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    keep_window_size: int = 2048
    is_moe: bool = False
    num_experts: int = 16384
    num_experts_per_tok: int = 64
    norm_topk_prob: bool = False
    # The first position where dynamic NTK scaling would change the RoPE base (None: the
    # config has none; see llmrun.models.internlm2).
    ntk_from: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return internlm2.with_plain_rope(cls, config)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.keep_window_size = args.keep_window_size
        kv_width = self.n_kv_heads * self.head_dim
        self.A = nn.Parameter(torch.zeros(self.n_kv_heads))
        self.dt_proj = nn.Linear(kv_width, self.n_kv_heads, bias=args.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normed per head before RoPE
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q.transpose(1, 2)), frame.rotate(k.transpose(1, 2))
        k, v = self._all_keys(k, v, frame, cache)
        bias = self.dynamic_mask(v, frame, tokens)
        out = attention(q, k, v, bias, self.head_dim**-0.5)
        return self.o_proj(out)

    def dynamic_mask(self, v: torch.Tensor, frame: Frame, tokens: int) -> torch.Tensor:
        """The additive mask [B, H, T, L] of `tokens` queries over values v [B, Hkv, L, D]:
        each KV head's bias on each key, -inf where frame.mask [B, 1, T, L] (True: attend)
        hides the key or where keep_window_size larger biases are seen."""
        batch, _, length, _ = v.shape
        # [B, Hkv, L, D] -> [B, L, Hkv*D] -> [B, L, Hkv] -> [B, Hkv, L]
        dt = self.dt_proj(v.transpose(1, 2).reshape(batch, length, -1))
        dt = torch.exp(self.A * F.softplus(dt)).transpose(1, 2)
        bias = dt[:, :, None, :].expand(-1, -1, tokens, -1)
        if frame.mask is not None:
            bias = bias.masked_fill(~frame.mask, float("-inf"))
        if length > self.keep_window_size:
            bias = self.keep_largest(bias, frame.positions)
        return bias.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)

    def keep_largest(self, bias: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """bias [B, Hkv, T, L] with all but each query's keep_window_size largest set to
        -inf, chosen by torch.topk as transformers chooses them. Equal biases (a token's
        repeats give equal values in the first layer) go topk's way, which depends on how
        many keys it is given: a batch's row is given its own keys alone (up to its last
        position), as a forward of its sequence alone gives them."""
        keep, length = self.keep_window_size, bias.shape[-1]
        ends = [length] if bias.shape[0] == 1 else (positions.amax(-1) + 1).tolist()
        out = torch.full_like(bias, float("-inf"))
        for row, end in enumerate(ends):
            own, kept_row = bias[row : row + 1, ..., :end], out[row : row + 1, ..., :end]
            if min(end, length) <= keep:
                kept_row.copy_(own)
                continue
            kept = torch.topk(own, keep, dim=-1, sorted=False).indices
            kept_row.scatter_(-1, kept, own.gather(-1, kept))
        return out

    def _all_keys(
        self, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new k/v [B, Hkv, T, D] stored, and every key and value the queries attend
        to (positions 0 .. frame.length - 1; the new ones alone without a cache), in k's
        dtype."""
        if cache is None:
            return k, v
        if cache.paged:
            cache.write(self.layer, k, v, frame.positions)
            return cache.read(self.layer, frame.length, k.dtype)
        if frame.static:
            return cache.update_static(self.layer, k, v, frame.positions, frame.length)
        return cache.update(self.layer, k, v, frame.positions, frame.start, frame.length)


class CDMoE(nn.Module):
    """The shared gated MLP plus the product-key experts (see the module docstring)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        bias, dim = args.mlp_bias, args.hidden_size
        self.num_keys = math.isqrt(args.num_experts)
        self.top_k, self.normalize = args.num_experts_per_tok, args.norm_topk_prob
        self.gate_proj = nn.Linear(dim, args.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(dim, args.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(args.intermediate_size, dim, bias=bias)
        self.router_gate = nn.Linear(dim, self.num_keys * 2, bias=False)
        self.down_embed = nn.Embedding(args.num_experts, dim)
        self.up_embed = nn.Embedding(args.num_experts, dim)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] at positions [B, T]; rows padded on the right (serve's: a padded
        token repeats the position before it) routed as their real tokens alone."""
        shared = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        counts = None
        if x.shape[1] > 1:
            counts = 1 + (positions[:, 1:] != positions[:, :-1]).sum(-1)
        if counts is None or bool((counts == x.shape[1]).all()):
            return shared + self.routed(x)
        routed = torch.zeros_like(x)
        for row, count in enumerate(counts.tolist()):
            routed[row, :count] = self.routed(x[row : row + 1, :count])[0]
        return shared + routed

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' sum [B, T, D] for x [B, T, D]."""
        batch, tokens, dim = x.shape
        keys = self.num_keys
        # A row's [T, 2 * keys] logits read as [2, T, keys], as transformers reads them.
        logits = self.router_gate(x).reshape(batch, 2, tokens, keys)
        scores, indices = logits.topk(keys, dim=-1)
        # [B, T, keys, keys] -> [B, T, keys^2]: expert (i, j) scores x_i + y_j
        pairs = (scores[:, 0, :, :, None] + scores[:, 1, :, None, :]).flatten(-2)
        experts = (indices[:, 0, :, :, None] * keys + indices[:, 1, :, None, :]).flatten(-2)
        scores, chosen = pairs.topk(self.top_k, dim=-1)
        experts = experts.gather(-1, chosen)
        weights = F.softmax(scores, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # [B*T, k, D] @ [B*T, D, 1] -> [B*T, k]
        rows = x.reshape(batch * tokens, dim, 1)
        down = self.down_embed(experts).view(batch * tokens, self.top_k, dim)
        mixed = self.act((down @ rows).view(batch * tokens, -1)) * weights.view(batch * tokens, -1)
        up = self.up_embed(experts).view(batch * tokens, self.top_k, dim)
        return (mixed.view(batch * tokens, 1, -1) @ up).view(batch, tokens, dim)


class DecoderLayer(nn.Module):
    """input_residual * x + attn(norm(x)), then post_attention_residual * x +
    mlp(norm(x)): residuals scaled per channel."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = attention(args, layer)
        self.input_residual = nn.Parameter(torch.ones(dim))
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = CDMoE(args) if args.is_moe else mlp(args)
        self.post_attention_residual = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = self.input_residual * x + self.self_attn(self.input_layernorm(x), frame, cache)
        h = self.post_attention_layernorm(x)
        h = self.mlp(h, frame.positions) if isinstance(self.mlp, CDMoE) else self.mlp(h)
        return self.post_attention_residual * x + h


class Model(CausalLM):
    embed_at = internlm2.Model.embed_at

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, DecoderLayer)
