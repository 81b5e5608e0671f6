"""GLM-5-Next (HF glm5_next, the language model of GLM-5.3-Flash: glm5_next_text;
llama.cpp's GGUF arch "glm5-next"). A hybrid of pieces other families have:

- most layers (layer_types "linear_attention", by default three of every four) are Kimi
  Linear's KDA (llmrun.models.kimi_linear: q, k, v convolutions, a delta rule with a
  decay per key channel, an output RMSNorm gated by sigmoid(g_b(g_a(x)))), but for the
  forget gate: with linear_lower_bound (default -5) the log decay is lower_bound *
  sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)), so each step keeps at least e^-5 of the
  state; without it Kimi's -exp(A_log) * softplus(...). A_log is one value per head;
- the others ("indexed_attention") are GLM-5's multi-head latent attention without RoPE
  (qk_rope_head_dim 0), latents normalized at rms_norm_eps, and DeepSeek sparse
  attention whose indexer scores pools rather than tokens: the keys of each complete
  pool of index_kpool tokens (from position 0) are averaged by a softmax per feature of
  index_kpool_compress_gate x + index_kpool_compress_ape (the token's place in its
  pool); a query takes the index_topk / index_kpool pools that score highest among
  those that end at or before it, and always the tokens of its own incomplete pool. A
  "shared" layer (indexer_types) takes the choice of the layer right before it, which
  must be a "full" indexed layer (transformers hands the choice on one layer only);
- the residual is DeepSeek-V4's hc_mult streams with its hyper-connections around each
  sublayer (llmrun.models.deepseek_v4), collapsed at the end by a plain mean;
- the feed-forward is dense where mlp_layer_types says so (the first three by default),
  else DeepSeek-V3's sigmoid-routed experts with a shared expert; every SwiGLU (dense,
  routed and shared) clamps its inputs at swiglu_limit, DeepSeek-V4's Expert.

The KV cache holds the indexed layers alone, one row per token: the normalized latent,
then for a full indexed layer its indexer key and gate scores (zeros in a shared
layer's), values the keys (cache_values_are_keys), so chunked prefill, --cache-type and
serve's paged blocks keep them as they keep the latent. The KDA layers' state is in
cache.recurrent (llmrun.models.recurrent). The Hub's names are Kimi Linear's for the
KDA layers (self_attn.q_conv1d, self_attn.A_log, ...) and hc_attn_fn, ... for the
hyper-connections (the loader renames those: llmrun.loading.glm5_next).

Reference: transformers/models/glm5_next/modeling_glm5_next.py (Glm5NextTextModel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import (
    deepseek_v2,
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    glm4_moe_lite,
    glm_moe_dsa,
    kimi_linear,
)
from llmrun.models.base import (
    Hybrid,
    RMSNorm,
    args_from_config,
    attend_scaled,
    attention,
    attention_mask,
    key_positions,
)
from llmrun.models.cache import KVCache
from llmrun.models.deepseek_v32 import IndexedFrame

LINEAR, INDEXED = "linear_attention", "indexed_attention"
LAYER_TYPES = (LINEAR, INDEXED)
MODEL_TYPES = ("glm5_next", "glm5_next_text")
# linear_attn_config's keys (the Hub's config.json) -> the flat fields.
_LINEAR_KEYS = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
    "gate_lower_bound": "linear_lower_bound",
}


@dataclass
class ModelArgs(glm4_moe_lite.ModelArgs):
    # Glm5NextTextConfig's defaults where they differ from GLM-4.7-Flash's.
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    max_position_embeddings: int = 1048576
    layer_types: list[str] | None = None
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    indexer_types: list[str] | None = None
    index_topk_pattern: str | list[str] | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.layer_types is None:  # transformers': every fourth layer from layer 3
            self.layer_types = [INDEXED if i % 4 == 3 else LINEAR for i in range(layers)]
        self.layer_types = [
            INDEXED if kind == "full_attention" else kind for kind in self.layer_types
        ]
        if len(self.layer_types) != layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelFormatError(
                f"layer_types is {self.layer_types!r}; it needs {layers} entries of "
                f"{' or '.join(LAYER_TYPES)}"
            )
        if self.mlp_layer_types is None:
            dense = min(3, layers)
            self.mlp_layer_types = ["dense"] * dense + ["sparse"] * (layers - dense)
        if self.indexer_types is None:
            self.indexer_types = glm_moe_dsa.derived_indexer_types(self)
        self.check_attention()
        super().__post_init__()

    def check_attention(self) -> None:
        """Refuse what transformers refuses or this model does not compute."""
        if self.q_lora_rank is None:
            raise UnsupportedError(
                "GLM-5-Next without q_lora_rank is not supported (the indexer's queries "
                "come from the queries' latent)"
            )
        if self.qk_rope_head_dim:
            raise UnsupportedError(
                f"GLM-5-Next with qk_rope_head_dim {self.qk_rope_head_dim} is not supported "
                "(its attention has no RoPE, as transformers requires)"
            )
        if not self.index_kpool_always_select_tail:
            raise UnsupportedError(
                "GLM-5-Next with index_kpool_always_select_tail false is not supported (a "
                "query would attend to no token before its first complete pool)"
            )
        if self.index_kpool < 1 or self.index_topk < self.index_kpool:
            raise ModelFormatError(
                f"index_kpool is {self.index_kpool} and index_topk {self.index_topk}; both "
                "must be positive, the top-k at least one pool"
            )
        if self.index_topk % self.index_kpool:
            raise ModelFormatError(
                f"index_topk ({self.index_topk}) must be a multiple of index_kpool "
                f"({self.index_kpool})"
            )
        kinds = self.indexer_types
        if len(kinds) < self.num_hidden_layers or not set(kinds) <= set(deepseek_v32.INDEXER_TYPES):
            raise ModelFormatError(
                f"indexer_types is {kinds!r}; it needs {self.num_hidden_layers} entries of "
                f"{' or '.join(deepseek_v32.INDEXER_TYPES)}"
            )
        for layer in self.attention_layers:
            if kinds[layer] == "shared" and (layer == 0 or not self.indexed(layer - 1)):
                raise ModelFormatError(
                    f"layer {layer} shares the indexer choice of the layer before it "
                    '(indexer_types "shared"), which is not an indexed attention layer '
                    "running its indexer (transformers hands the choice on to the next "
                    "layer only)"
                )

    @property
    def attention_layers(self) -> list[int]:
        """The indexed attention layers, in order: the KV cache's layers."""
        return [i for i, kind in enumerate(self.layer_types) if kind == INDEXED]

    def indexed(self, layer: int) -> bool:
        """Whether `layer` is an attention layer that runs an indexer of its own."""
        return self.layer_types[layer] == INDEXED and self.indexer_types[layer] == "full"

    @property
    def cache_head_dim(self) -> int:
        """The latent, then the indexer's key and its pool gate scores."""
        return self.kv_lora_rank + 2 * self.index_head_dim

    @property
    def indexer_rope_pairs(self) -> bool:
        return False  # no RoPE to turn: DeepSeek-V3.2's Indexer reads it all the same

    layer_windows = kimi_linear.ModelArgs.layer_windows
    recurrent_shapes = kimi_linear.ModelArgs.recurrent_shapes

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """A glm5_next config.json (its text_config, or the text fields at the top
        level), or a glm5_next_text one."""
        config = dict(config.get("text_config") or config)
        linear = config.get("linear_attn_config")
        if linear is not None:
            for old, new in _LINEAR_KEYS.items():
                if old in linear:
                    config[new] = linear[old]
            if linear.get("safe_gate", True) and config.get("linear_lower_bound", -5.0) is None:
                config["linear_lower_bound"] = -5.0
        # transformers' head_dim is the RoPE part's width: 0, not a size of this model.
        config.pop("head_dim", None)
        if "n_routed_experts" not in config and "num_local_experts" in config:
            config["n_routed_experts"] = config["num_local_experts"]
        # transformers normalizes the latents with rms_norm_eps.
        config.setdefault("latent_norm_eps", config.get("rms_norm_eps", cls.rms_norm_eps))
        return args_from_config(
            cls, config, nullable=("q_lora_rank", "n_shared_experts", "linear_lower_bound")
        )


class DeltaAttention(kimi_linear.DeltaAttention):
    """Kimi Linear's KDA with one A_log per head and the lower-bounded forget gate."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.A_log = nn.Parameter(torch.zeros(self.heads))  # Kimi's is [1, 1, heads, 1]
        self.lower_bound = args.linear_lower_bound

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        gate = self.forget_input(x).float() + self.dt_bias.float()
        gate = gate.view(batch, tokens, self.heads, -1)  # [B, T, heads, dim]
        rate = self.A_log.float().exp()[:, None]  # [heads, 1]
        if self.lower_bound is None:
            return -rate * F.softplus(gate)
        return self.lower_bound * torch.sigmoid(rate * gate)


class Indexer(deepseek_v32.Indexer):
    """DeepSeek-V3.2's indexer projections, scoring pools of index_kpool keys."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.kpool = args.index_kpool
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, args.hidden_size))

    def row(self, x: torch.Tensor) -> torch.Tensor:
        """What each token of x [B, T, hidden] caches for the indexer: its key, then its
        pool gate scores, [B, 1, T, 2 * D]."""
        key = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate.to(x.dtype))
        return torch.cat((key, gate), dim=-1)[:, None]

    def choose(
        self, x: torch.Tensor, q_resid: torch.Tensor, rows: torch.Tensor, frame: IndexedFrame
    ) -> torch.Tensor:
        """Which of the L keys each query of x [B, T, hidden] attends to, given the
        indexer's rows [B, 1, L, 2 * D] of every position: a mask [B, 1, T, L]."""
        batch, tokens, _ = x.shape
        length, pool = rows.shape[2], self.kpool
        pools = length // pool  # complete pools only
        keys, gates = rows[:, 0, : pools * pool].float().split(self.head_dim, dim=-1)
        # [B, P * pool, D] -> [B, P, pool, D]: a softmax per feature over each pool
        mix = torch.softmax(
            gates.view(batch, pools, pool, -1) + self.index_kpool_compress_ape.float(), dim=2
        )
        pooled = (mix * keys.view(batch, pools, pool, -1)).sum(dim=2)  # [B, P, D]
        q = self.wq_b(q_resid).view(batch, tokens, self.n_heads, self.head_dim)
        # [B, T, H, D] @ [B, 1, D, P] -> [B, T, H, P]
        scores = F.relu(torch.matmul(q.float(), pooled.transpose(-1, -2)[:, None]))
        scores = scores * self.head_dim**-0.5
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # [B, T, H]
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, T, P]
        positions = frame.positions[:, :, None]  # [B, T, 1]
        ends = torch.arange(1, pools + 1, device=x.device) * pool - 1
        closed = ends <= positions  # [B, T, P]: the pools a query may take
        index = index.masked_fill(~closed, float("-inf"))
        top = index.topk(min(self.topk // pool, pools), dim=-1).indices
        taken = torch.zeros_like(closed).scatter_(-1, top, True) & closed
        chosen = F.pad(taken.repeat_interleave(pool, dim=-1), (0, length - pools * pool))
        # The query's own pool if it is incomplete: the positions from its start to it
        # (none where the query closes its pool, which is then a candidate like others).
        keys_at = torch.arange(length, device=x.device)
        seen = positions + 1
        tail = (keys_at >= seen - seen % pool) & (keys_at < seen)
        return (chosen | tail)[:, None]


class Attention(deepseek_v2.Attention):
    """GLM-5's latent attention without RoPE, over the tokens of the pools the indexer
    chose (a shared layer: those the layer before it chose)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.attention_layers.index(layer))
        self.index_dim, self.topk, self.kpool = (
            args.index_head_dim,
            args.index_topk,
            args.index_kpool,
        )
        self.indexer = Indexer(args) if args.indexed(layer) else None

    def rotate(self, x: torch.Tensor, frame: IndexedFrame) -> torch.Tensor:
        return x  # NoPE

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        frame: IndexedFrame,
        cache: KVCache | None,
        x: torch.Tensor,
        q_resid: torch.Tensor | None,
    ) -> torch.Tensor:
        indexer, extra = self.indexer, 2 * self.index_dim
        # The indexer's row cached next to the latent (a shared layer caches zeros); the
        # queries' zeros over it add nothing to the scores.
        k = torch.cat((k, indexer.row(x)), dim=-1) if indexer else F.pad(k, (0, extra))
        q = F.pad(q, (0, extra))
        if frame.length // self.kpool <= self.topk // self.kpool:  # every pool is taken
            if indexer is not None:
                frame.chosen = None
            return attend_scaled(q, k, k, self.layer, frame, cache, self.scale)
        if cache is not None:
            k, _ = cache.update(self.layer, k, k, frame.positions, frame.start, frame.length)
        if indexer is not None:
            frame.chosen = indexer.choose(x, q_resid, k[..., -extra:], frame)
        return attention(q, k, k, frame.chosen, self.scale)


class MoE(deepseek_v3.MoE):
    """DeepSeek-V3's routed and shared experts, every one with the clamped SwiGLU."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.experts = nn.ModuleList(deepseek_v4.Expert(args) for _ in range(args.n_routed_experts))
        width = args.moe_intermediate_size * (args.n_shared_experts or 1)
        self.shared_experts = deepseek_v4.Expert(args, width) if args.n_shared_experts else None


class Layer(nn.Module):
    """KDA or indexed attention, then a dense or experts feed-forward, each reading and
    writing the streams through its hyper-connection."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        linear = args.layer_types[layer] == LINEAR
        self.self_attn = DeltaAttention(args, layer) if linear else Attention(args, layer)
        self.mlp = (
            MoE(args) if args.sparse(layer) else deepseek_v4.Expert(args, args.intermediate_size)
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn_hc = deepseek_v4.HyperConnection(args)
        self.ffn_hc = deepseek_v4.HyperConnection(args)

    def forward(
        self, streams: torch.Tensor, frame: IndexedFrame, cache: KVCache | None
    ) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), frame, cache)
        streams = deepseek_v4.spread(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x))
        return deepseek_v4.spread(streams, out, post, comb)


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(nn.Module):
    """embed -> hc_mult streams -> layers -> their mean -> norm -> lm_head, with
    transformers' module names (the text model's)."""

    decode_step = None  # no native decode step: see llmrun.quant.decode_step.FAMILIES
    new_cache = Hybrid.new_cache

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

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
        row's last real token) of input_ids [B, T] at positions [B, T]."""
        if static is not None:
            raise UnsupportedError("GLM-5-Next has no static decode step (CUDA graphs)")
        x = self.model.embed_tokens(input_ids)
        frame = self.frame(positions, cache, x.dtype)
        # [B, T, D] -> [B, T, n, D]: every stream starts as the embedding
        x = x[:, :, None].expand(-1, -1, self.args.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            x = layer(x, frame, cache)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x.mean(dim=2))).float()

    def frame(
        self, positions: torch.Tensor, cache: KVCache | None, dtype: torch.dtype
    ) -> IndexedFrame:
        """The causal mask of the attention layers (no RoPE: empty angles) and, with a
        recurrent state, each row's real token count (RecurrentState.begin)."""
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        if cache is None and start != 0:
            raise UnsupportedError("GLM-5-Next without a KV cache starts at position 0")
        mask = attention_mask(positions, key_positions(positions, length, cache))
        angles = torch.zeros(
            positions.shape[0], 1, positions.shape[1], 0, dtype=dtype, device=positions.device
        )
        frame = IndexedFrame(positions, start, length, mask, angles, angles)
        if cache is not None and cache.recurrent is not None:
            frame.counts = cache.recurrent.begin(positions)
        return frame
