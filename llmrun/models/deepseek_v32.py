"""DeepSeek-V3.2 (HF deepseek_v32; llama.cpp's GGUF arch "deepseek32"): DeepSeek-V3's
model (multi-head latent attention over a cached latent, sigmoid-scored experts) with
DeepSeek Sparse Attention: each query attends to the index_topk earlier tokens its
layer's lightning indexer scores highest, not to all of them.

The indexer: per query, index_n_heads small heads of index_head_dim from the queries'
latent (q_a_layernorm's output, through wq_b); per token one key from the hidden state
(wk, then a LayerNorm with bias, k_norm); RoPE on the first qk_rope_head_dim features of
both (half-split here, adjacent pairs in GLM-5), the main attention's angles. A key's
score for a query is sum_h w_h * relu(q_h . k * index_head_dim^-0.5), where w =
weights_proj(hidden) * index_n_heads^-0.5; the top index_topk keys among those the query
may see (the causal mask) are attended to, in the ordinary softmax. Where a query sees
index_topk keys or fewer it attends to all of them, so the indexer runs only once a
sequence is longer than that.

The KV cache holds each token's indexer key next to its latent: one head of kv_lora_rank
+ qk_rope_head_dim + index_head_dim features (704 for the released shapes, where MLA
alone keeps 576), stored once as keys and values (cache_values_are_keys), so the
contiguous cache, chunked prefill, --cache-type and serve's paged blocks keep it as they
keep the latent. The queries get zeros for those features: the attention scores are the
latent's, and the outputs' extra features are dropped with the rope part.

The Hub's checkpoints end with a multi-token-prediction layer past num_hidden_layers,
which transformers ignores, and so does llmrun.

Reference: transformers/models/deepseek_v32/modeling_deepseek_v32.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2, deepseek_v3, glm4_moe_lite
from llmrun.models.base import Frame, args_from_config, attend_scaled, attention, rotate_pairs
from llmrun.models.cache import KVCache

# transformers builds the indexer's k_norm as nn.LayerNorm(index_head_dim, eps=1e-6), as
# llama.cpp's deepseek32 sets its f_norm_eps.
INDEXER_NORM_EPS = 1e-6
INDEXER_TYPES = ("full", "shared")


@dataclass
class ModelArgs(glm4_moe_lite.ModelArgs):
    # DeepseekV32Config's defaults where they differ from GLM-4.7-Flash's.
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int | None = 8
    topk_group: int | None = 4
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    first_k_dense_replace: int = 3
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    # Per layer, "full" (runs its indexer) or "shared" (reuses the keys the last full
    # layer chose: GLM-5); DeepSeek-V3.2's layers are all full.
    indexer_types: list[str] | None = None

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.mlp_layer_types is None:  # transformers: from first_k_dense_replace
            dense = min(self.first_k_dense_replace, layers)
            self.mlp_layer_types = ["dense"] * dense + ["sparse"] * (layers - dense)
        self.check_queries()
        if not 0 < self.qk_rope_head_dim <= self.index_head_dim:
            raise ModelFormatError(
                f"index_head_dim is {self.index_head_dim}, but RoPE turns "
                f"qk_rope_head_dim {self.qk_rope_head_dim} of its features"
            )
        if self.index_topk < 1 or self.index_n_heads < 1:
            raise ModelFormatError(
                f"index_topk {self.index_topk} and index_n_heads {self.index_n_heads} "
                "must be positive"
            )
        kinds = self.indexer_types or ["full"] * layers
        if len(kinds) < layers or not set(kinds) <= set(INDEXER_TYPES) or kinds[0] != "full":
            raise ModelFormatError(
                f"indexer_types is {kinds!r}; it needs {layers} entries of "
                f"{' or '.join(INDEXER_TYPES)}, the first full (a shared layer reuses the "
                "keys an earlier full layer chose)"
            )
        self.indexer_types = list(kinds[:layers])
        super().__post_init__()

    def check_queries(self) -> None:
        """Refuse queries the indexer cannot read: it reads the queries' latent."""
        if self.q_lora_rank is None:
            raise UnsupportedError(
                "DeepSeek sparse attention without q_lora_rank is not supported (the "
                "indexer's queries come from the queries' latent)"
            )

    @property
    def cache_head_dim(self) -> int:
        """The latent, its rotated rope part and the indexer's key."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    @property
    def indexer_rope_pairs(self) -> bool:
        """Whether the indexer's RoPE turns adjacent pairs (GLM-5) or halves (V3.2)."""
        return False

    def indexed(self, layer: int) -> bool:
        """Whether `layer` runs an indexer of its own."""
        return self.indexer_types[layer] == "full"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # transformers turns the main attention's RoPE in adjacent pairs whatever
        # rope_interleave says.
        config = {k: v for k, v in config.items() if k != "rope_interleave"}
        if "n_routed_experts" not in config and "num_local_experts" in config:
            config["n_routed_experts"] = config["num_local_experts"]
        return args_from_config(cls, config, nullable=("q_lora_rank", "n_shared_experts"))


@dataclass
class IndexedFrame(Frame):
    """A Frame that carries a full indexer layer's choice of keys, [B, 1, T, L] (None:
    every key it may see), to the shared layers after it."""

    chosen: torch.Tensor | None = None


class Indexer(nn.Module):
    """The lightning indexer: which keys each query attends to."""

    def __init__(self, args: ModelArgs, query_width: int | None = None) -> None:
        """`query_width`: that of what its queries are projected from (wq_b's input),
        default the queries' latent (q_lora_rank)."""
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk, self.pairs = args.index_topk, args.indexer_rope_pairs
        width = args.q_lora_rank if query_width is None else query_width
        self.wq_b = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)

    def key(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        """Each token's key [B, 1, T, D] of x [B, T, hidden], rotated."""
        return self.rotate(self.k_norm(self.wk(x))[:, None], frame)

    def choose(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        keys: torch.Tensor,
        frame: Frame,
    ) -> torch.Tensor:
        """Which keys each query of x [B, T, hidden] attends to, given the indexer's
        keys [B, 1, L, D] of every position: the index_topk that score highest among
        those frame.mask lets it see, as a mask [B, 1, T, L] (True: attend) that
        includes frame.mask."""
        q = self.queries(q_resid, frame)
        # [B, T, H, D] @ [B, 1, D, L] -> [B, T, H, L]
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float()) * self.head_dim**-0.5
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # [B, T, H]
        # [B, T, 1, H] @ [B, T, H, L] -> [B, T, L]
        index = torch.matmul(weights.unsqueeze(-2), F.relu(scores)).squeeze(-2)
        mask = frame.mask
        if mask is not None:
            index = index.masked_fill(~mask[:, 0], float("-inf"))
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)[:, None]
        return chosen if mask is None else chosen & mask

    def queries(self, q_resid: torch.Tensor, frame: Frame) -> torch.Tensor:
        """The indexer's queries [B, T, H, D] of the queries' latent q_resid [B, T, rank],
        rotated."""
        batch, tokens, _ = q_resid.shape
        # [B, T, H*D] -> [B, H, T, D] to rotate, then [B, T, H, D]
        q = self.wq_b(q_resid).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        return self.rotate(q, frame).transpose(1, 2)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        """RoPE on the first qk_rope_head_dim features of x [B, H, T, D]."""
        return rotate_pairs(x, frame) if self.pairs else frame.rotate(x)


class Attention(deepseek_v2.Attention):
    """MLA over the keys the indexer chose (a shared layer: those of the full layer
    before it)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.index_dim, self.topk = args.index_head_dim, args.index_topk
        self.indexer = self.make_indexer(args, layer) if args.indexed(layer) else None

    def make_indexer(self, args: ModelArgs, layer: int) -> nn.Module:
        """The indexer of `layer`, one that runs its own: DeepSeek-V3.2's, here."""
        return Indexer(args)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        frame: IndexedFrame,
        cache: KVCache | None,
        x: torch.Tensor,
        q_resid: torch.Tensor | None,
    ) -> torch.Tensor:
        indexer = self.indexer
        if indexer is not None:
            # The indexer's key cached next to the latent (a shared layer caches zeros).
            k = torch.cat((k, indexer.key(x, frame)), dim=-1)
        else:
            k = F.pad(k, (0, self.index_dim))
        q = F.pad(q, (0, self.index_dim))  # the indexer's features add nothing to the scores
        if frame.length <= self.topk:  # every query sees index_topk keys or fewer
            if indexer is not None:
                frame.chosen = None
            return self.attend_all(q, k, frame, cache)
        if cache is not None:
            k, _ = cache.update(self.layer, k, k, frame.positions, frame.start, frame.length)
        if indexer is not None:
            frame.chosen = indexer.choose(x, q_resid, k[..., -self.index_dim :], frame)
        return self.attend_chosen(q, k, frame.chosen)

    def attend_all(
        self, q: torch.Tensor, k: torch.Tensor, frame: IndexedFrame, cache: KVCache | None
    ) -> torch.Tensor:
        """The queries over the new keys k and those cached, all that frame.mask lets
        each see; [B, T, H*D]."""
        return attend_scaled(q, k, k, self.layer, frame, cache, self.scale)

    def attend_chosen(
        self, q: torch.Tensor, k: torch.Tensor, chosen: torch.Tensor | None
    ) -> torch.Tensor:
        """The queries over the keys k [B, 1, L, D] of every position that `chosen`
        [B, 1, T, L] (None: all) lets each see; [B, T, H*D]."""
        return attention(q, k, k, chosen, self.scale)


class Model(deepseek_v3.Model):
    """DeepSeek-V3's model (its dense layers: glm4_moe_lite's mlp_layer_types) with the
    indexed attention."""

    attention = Attention

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> IndexedFrame:
        frame = super().frame(positions, cache, dtype, last)
        return IndexedFrame(**{f.name: getattr(frame, f.name) for f in dataclasses.fields(frame)})
