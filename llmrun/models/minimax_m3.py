"""MiniMax-M3 (text; the language model of MiniMaxAI's MiniMax-M3 checkpoints, model_type
minimax_m3_vl, whose vision tower llmrun ignores): MiniMax-M2's grouped-query attention
with partial RoPE, but with Gemma-style (1 + w) RMS norms everywhere and the q/k norms per
head; MiniMax Sparse Attention on the layers layer_types marks "minimax_m3_sparse"; a
SwiGLU-OAI feed-forward (clamped gate and up, gate * sigmoid(alpha * gate) * (up + 1)):
dense on the layers mlp_layer_types marks "dense", else a mixture of experts routed as
MiniMax-M2's (sigmoid, top-k by score + e_score_correction_bias, renormalized) times
routed_scaling_factor, plus one shared expert.

Sparse attention: a lightning indexer (index_n_heads heads of index_head_dim, one per KV
head, its own (1 + w) q/k norms and RoPE) scores every earlier key; the scores are
max-pooled over blocks of index_block_size positions, the index_local_blocks blocks ending
at the query's own are always kept, and each KV group attends only to the keys of its
index_topk_blocks best blocks. While a sequence has no more than index_topk_blocks blocks
every block is kept, which is plain causal attention. The cache holds each token's
indexer key after its attention key (values padded to the same width with zeros).

Reference: transformers/models/minimax_m3_vl/modeling_minimax_m3_vl.py (MiniMaxM3VLForCausalLM
over MiniMaxM3VLTextConfig). Parameter names are the Hub checkpoint's, which transformers
renames on load (conversion_mapping.py): block_sparse_moe.experts.N.w1/w3/w2,
block_sparse_moe.gate, block_sparse_moe.e_score_correction_bias,
block_sparse_moe.shared_experts and a dense layer's mlp with gate_proj/up_proj/down_proj,
self_attn.index_q_proj/index_k_proj/index_q_norm/index_k_norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    GemmaRMSNorm,
    args_from_config,
    attend_scaled,
    attention,
    cached_keys_values,
    check_top_k,
    mix_experts,
    route_grouped,
)
from llmrun.models.cache import KVCache

ROPE_THETA = 5_000_000.0  # MiniMaxM3VLTextConfig.default_theta
SPARSE, SPARSE_MLP = "minimax_m3_sparse", "sparse"
# MiniMax's config.json keeps the indexer's settings in sparse_attention_config.
LEGACY_INDEX_KEYS = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}


@dataclass
class ModelArgs:
    # MiniMaxM3VLTextConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 3072  # each routed expert's
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 524288
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mlp_layer_types: list[str] | None = None
    layer_types: list[str] | None = None
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        self.layer_types = list(self.layer_types or ["full_attention"] * layers)
        self.mlp_layer_types = list(self.mlp_layer_types or [SPARSE_MLP] * layers)
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) < layers:
                raise ModelFormatError(f"{name} has fewer than {layers} entries")
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")
        if SPARSE in self.layer_types[:layers]:
            if self.index_n_heads != self.num_key_value_heads:
                raise UnsupportedError(
                    f"MiniMax-M3 with {self.index_n_heads} indexer heads for "
                    f"{self.num_key_value_heads} KV heads is not supported (one per KV group)"
                )
            if min(self.index_block_size, self.index_topk_blocks) < 1:
                raise ModelFormatError("index_block_size and index_topk_blocks must be positive")

    def sparse(self, layer: int) -> bool:
        """Whether `layer` runs MiniMax Sparse Attention."""
        return self.layer_types[layer] == SPARSE

    @property
    def cache_head_dim(self) -> int:
        """The cached width of every layer: the head, and the indexer's key after it
        where any layer is sparse (one width for all layers, the cache's)."""
        sparse = any(self.sparse(i) for i in range(self.num_hidden_layers))
        return self.head_dim + (self.index_head_dim if sparse else 0)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config.get("text_config") or config)
        for legacy, flat in LEGACY_INDEX_KEYS.items():
            value = (config.get("sparse_attention_config") or {}).get(legacy)
            if value is not None:
                config.setdefault(flat, value)
        sparse_config = config.get("sparse_attention_config") or {}
        if config.get("layer_types") is None and "sparse_attention_freq" in sparse_config:
            config["layer_types"] = [
                SPARSE if f else "full_attention" for f in sparse_config["sparse_attention_freq"]
            ]
        if config.get("mlp_layer_types") is None and config.get("moe_layer_freq") is not None:
            config["mlp_layer_types"] = [
                SPARSE_MLP if f else "dense" for f in config["moe_layer_freq"]
            ]
        config = {"rope_theta": ROPE_THETA, **config}
        if config.get("rotary_dim") is not None and "partial_rotary_factor" not in config:
            config["partial_rotary_factor"] = config["rotary_dim"] / (
                config.get("head_dim") or cls.head_dim
            )
        if "num_local_experts" not in config and "num_experts" in config:
            config["num_local_experts"] = config["num_experts"]
        return args_from_config(cls, config)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate * sigmoid(alpha * gate) * (up + 1), gate clamped above and up both ways at limit."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1.0)


class DenseMLP(nn.Module):
    """down(swiglu_oai(gate(x), up(x))): the dense layers' feed-forward and the shared expert."""

    def __init__(self, args: ModelArgs, width: int) -> None:
        super().__init__()
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(
            swiglu_oai(self.gate_proj(x), self.up_proj(x), self.alpha, self.limit)
        )


class Expert(nn.Module):
    """A routed expert under the checkpoint's names: w1 the gate, w3 the up, w2 the down."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.glu(self.w1(x), self.w3(x)))

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gate and up projections combined (also llmrun.quant.experts' fused path)."""
        return swiglu_oai(gate, up, self.alpha, self.limit)


class SparseMoeBlock(nn.Module):
    """Routed experts (MiniMax-M2's routing, scaled by routed_scaling_factor) plus one
    shared expert."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.scale = args.num_experts_per_tok, args.routed_scaling_factor
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_local_experts))
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.num_local_experts))
        self.shared_experts = DenseMLP(args, args.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, H] -> [B*T, H]
        logits = F.linear(x2.float(), self.gate.weight.float())
        bias = self.e_score_correction_bias.float()
        weights, indices = route_grouped(
            logits, self.top_k, "sigmoid", bias, normalize=True, scale=self.scale
        )
        routed = mix_experts(x2, weights.to(x.dtype), indices, self.experts)
        return (routed + self.shared_experts(x2)).view(x.shape)


class Indexer:
    """The lightning indexer's arithmetic, over its attention layer's index_* parameters:
    which blocks of keys each KV group of a query attends to."""

    def __init__(self, args: ModelArgs) -> None:
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.block, self.topk, self.local = (
            args.index_block_size,
            args.index_topk_blocks,
            args.index_local_blocks,
        )

    def choose(self, q: torch.Tensor, keys: torch.Tensor, frame: Frame) -> torch.Tensor:
        """Which keys each KV group of the indexer's queries q [B, Hi, T, D] attends to,
        given its keys [B, 1, L, D] at positions 0..L-1: a mask [B, Hi, T, L] (True:
        attend) that includes frame.mask."""
        batch, heads, tokens, _ = q.shape
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2))  # [B, Hi, T, L]
        length = scores.shape[-1]
        if frame.mask is not None:
            scores = scores.masked_fill(~frame.mask, float("-inf"))
        blocks = -(-length // self.block)
        padded = F.pad(scores, (0, blocks * self.block - length), value=float("-inf"))
        block_scores = padded.view(batch, heads, tokens, blocks, self.block).amax(-1)
        own = frame.positions // self.block  # [B, T]
        for back in range(self.local):  # the local blocks rank first
            local = (own - back).clamp(min=0)[:, None, :, None].expand(-1, heads, -1, 1)
            block_scores.scatter_(-1, local, float("inf"))
        top = block_scores.topk(min(self.topk, blocks), dim=-1)
        kept = torch.zeros_like(block_scores, dtype=torch.bool)
        kept.scatter_(-1, top.indices, True)  # blocks with nothing visible: frame.mask's
        chosen = kept.repeat_interleave(self.block, dim=-1)[..., :length]
        return chosen if frame.mask is None else chosen & frame.mask


class Attention(nn.Module):
    """Grouped-query attention with per-head (1 + w) q/k norms and partial RoPE; on the
    sparse layers, over the keys of the blocks the indexer chose."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)
        self.cache_width = args.cache_head_dim
        self.indexer = Indexer(args) if args.sparse(layer) else None
        if self.indexer is not None:
            heads, width = args.index_n_heads, args.index_head_dim
            self.index_q_proj = nn.Linear(args.hidden_size, heads * width, bias=False)
            self.index_k_proj = nn.Linear(args.hidden_size, width, bias=False)
            self.index_q_norm = GemmaRMSNorm(width, args.rms_norm_eps)
            self.index_k_norm = GemmaRMSNorm(width, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, T, H, D], normalized per head, -> [B, H, T, D]
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, -1)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, -1)).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, -1).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        scale = self.head_dim**-0.5
        if self.indexer is not None:
            return self.o_proj(self.sparse(q, k, v, x, frame, cache, scale))
        if self.cache_width == self.head_dim:
            return self.o_proj(attend_scaled(q, k, v, self.layer, frame, cache, scale))
        # A dense layer of a model with sparse ones: cached as wide, the extra zeros.
        extra = self.cache_width - self.head_dim
        q, k, v = (F.pad(t, (0, extra)) for t in (q, k, v))
        return self.o_proj(self.narrow(attend_scaled(q, k, v, self.layer, frame, cache, scale)))

    def narrow(self, out: torch.Tensor) -> torch.Tensor:
        """[B, T, H*(D+extra)] attention output -> [B, T, H*D]: the padded features dropped."""
        batch, tokens, _ = out.shape
        return out.view(batch, tokens, self.n_heads, -1)[..., : self.head_dim].flatten(2)

    def sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        x: torch.Tensor,
        frame: Frame,
        cache: KVCache | None,
        scale: float,
    ) -> torch.Tensor:
        """Attention over the indexer's blocks. The indexer key rides in the cache after
        each KV head's key; queries and values are zero-padded over it, so it adds nothing
        to the scores and the output's padded features are dropped."""
        indexer = self.indexer
        batch, tokens, _ = x.shape
        extra = indexer.head_dim
        # [B, T, Di] -> [B, 1, T, Di], normalized and rotated, one copy per KV head
        index_key = self.index_k_norm(self.index_k_proj(x).view(batch, 1, tokens, extra))
        index_key = frame.rotate(index_key).expand(-1, self.n_kv_heads, -1, -1)
        k = torch.cat((k, index_key.to(k.dtype)), dim=-1)
        q, v = F.pad(q, (0, extra)), F.pad(v, (0, extra))
        if frame.length <= indexer.block * indexer.topk:  # every block is kept
            out = attend_scaled(q, k, v, self.layer, frame, cache, scale)
        else:
            if cache is not None and cache.paged:  # serve's blocks, read in position order
                cache.write(self.layer, k, v, frame.positions)
                k, v = cache.read(self.layer, frame.length, q.dtype)
            else:
                k, v = cached_keys_values(k, v, self.layer, frame, cache, 0)
            index_q = self.index_q_proj(x).view(batch, tokens, indexer.n_heads, extra)
            index_q = frame.rotate(self.index_q_norm(index_q).transpose(1, 2))
            chosen = indexer.choose(index_q, k[:, :1, :, -extra:], frame)
            chosen = chosen.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            out = attention(q, k, v, chosen, scale)
        return self.narrow(out)


class DecoderLayer(nn.Module):
    """Attention and a dense or mixture-of-experts feed-forward, each after a (1 + w) norm."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        # The checkpoint's names: block_sparse_moe for the experts, mlp for a dense layer.
        self.moe = args.mlp_layer_types[layer] == SPARSE_MLP
        if self.moe:
            self.block_sparse_moe = SparseMoeBlock(args)
        else:
            self.mlp = DenseMLP(args, args.dense_intermediate_size)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        mlp = self.block_sparse_moe if self.moe else self.mlp
        return x + mlp(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer, norm)
