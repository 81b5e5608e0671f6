"""Dots 3 Note (HF dots3_note and its text model dots3_note_text; llama.cpp's GGUF arch
"dots3note"): the language model of dots-studio's Dots 3 Note Preview (its vision and
audio towers are not run). DeepSeek-V3.2's model (multi-head latent attention over a
cached latent, sigmoid-scored experts with shared ones) with GLM-5's lightning indexer
(adjacent-pair RoPE) and these differences:

- two kinds of attention layer (layer_types): "indexed_attention" layers run the
  indexer over every earlier token; "sliding_attention" layers have no indexer and
  see the last sliding_window tokens, with MLA shapes of their own (per_layer_config:
  heads, LoRA ranks, head sizes) and a RoPE base of their own ("full_attention", the
  released checkpoints' name for a layer with use_dsa false, attends to every key);
- the queries' and the keys' normalized latents are scaled by sqrt(hidden_size /
  their rank) (the indexer's queries read the scaled one);
- the keys' shared rope part is RMS-normalized (k_rope_only_layernorm) before RoPE;
- each head's output is gated by sigmoid(g_proj(x)), one gate a head, before o_proj;
- the shared experts are shared_experts_intermediate_size wide, apart from the routed
  ones' moe_intermediate_size.

The KV cache holds each layer in its own width: an indexed layer's latent, rope part
and indexer key (DeepSeek-V3.2's), a sliding layer's latent and rope part, in a ring of
its window where the cache is longer.

The released config.json's own names (swa_* for the sliding layers, use_dsa,
sliding_window_size, ...) are read as transformers reads them, and a variant
transformers' model does not compute (another attention gate, the latent scaling off,
another norm) is refused: llmrun/models/dots3_note_config.py.

Reference: transformers/models/dots3_note/modeling_dots3_note.py (modular_dots3_note.py).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2, deepseek_v3, deepseek_v32
from llmrun.models.base import (
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    layer_frames,
    rope_parameters,
)
from llmrun.models.cache import KVCache
from llmrun.models.deepseek_v32 import IndexedFrame
from llmrun.models.dots3_note_config import (
    DEFAULT_WINDOW,
    FULL,
    INDEXED,
    LAYER_TYPES,
    PER_LAYER_FIELDS,
    SLIDING,
    transformers_names,
)
from llmrun.models.qwen3_moe import MLP


@dataclass
class ModelArgs(deepseek_v32.ModelArgs):
    # Dots3NoteTextConfig's defaults where they differ from DeepSeek-V3.2's.
    intermediate_size: int = 13824
    moe_intermediate_size: int = 1536
    shared_experts_intermediate_size: int = 1536
    routed_scaling_factor: float = 1.0
    n_group: int | None = 1
    topk_group: int | None = 1
    q_lora_rank: int | None = 1024
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    latent_norm_eps: float = 1e-5  # transformers' latent norms take rms_norm_eps here
    max_position_embeddings: int = 524288
    first_k_dense_replace: int = 1
    layer_types: list[str] | None = None
    sliding_window: int = DEFAULT_WINDOW
    # Layer index (a string in config.json) -> the attention fields it sets otherwise.
    per_layer_config: dict[Any, dict[str, Any]] | None = None
    local_rope_parameters: dict[str, Any] = field(default_factory=dict)
    # Not a config.json field: False where the scale is in the norms' weights already
    # (llama.cpp's converter folds it in, and its graph does not scale).
    lora_rescale: bool = True

    def __post_init__(self) -> None:
        kinds = self.layer_types or [INDEXED] * self.num_hidden_layers
        if len(kinds) != self.num_hidden_layers or not set(kinds) <= set(LAYER_TYPES):
            raise ModelFormatError(
                f"layer_types is {kinds!r}; it needs {self.num_hidden_layers} entries of "
                f"{', '.join(LAYER_TYPES)}"
            )
        self.layer_types = list(kinds)
        overrides = {int(i): dict(v) for i, v in (self.per_layer_config or {}).items()}
        for i, values in overrides.items():
            unknown = sorted(set(values) - set(PER_LAYER_FIELDS))
            if unknown or not 0 <= i < self.num_hidden_layers:
                raise UnsupportedError(
                    f"per_layer_config for layer {i} sets {', '.join(unknown) or 'a missing layer'}"
                    f", which Dots 3 Note does not (it may set {', '.join(PER_LAYER_FIELDS)})"
                )
        self.per_layer_config = overrides
        if self.n_shared_experts is None or self.n_shared_experts < 1:
            raise ModelFormatError("Dots 3 Note needs at least one shared expert")
        super().__post_init__()
        for i, kind in enumerate(self.layer_types):
            layer = self.layer_args(i)
            if layer.qk_rope_head_dim != self.rope_dims()[kind == SLIDING]:
                raise UnsupportedError(
                    "Dots 3 Note whose layers of one kind turn different numbers of RoPE "
                    "features (qk_rope_head_dim) is not supported"
                )
            if layer.q_lora_rank is None:
                raise UnsupportedError(f"Dots 3 Note layer {i} without q_lora_rank")
            heads = overrides.get(i, {}).get("num_key_value_heads", layer.num_attention_heads)
            if heads != layer.num_attention_heads:
                raise ModelFormatError(
                    f"layer {i}: num_key_value_heads {heads} is not num_attention_heads "
                    f"{layer.num_attention_heads}, as Dots 3 Note's MLA needs"
                )

    def layer_args(self, layer: int) -> ModelArgs:
        """These args with `layer`'s own attention fields (per_layer_config)."""
        values = {
            k: v
            for k, v in (self.per_layer_config or {}).get(layer, {}).items()
            if k not in ("head_dim", "num_key_value_heads")  # MLA: one latent head
        }
        if not values:
            return self
        args = copy.copy(self)
        for name, value in values.items():
            setattr(args, name, value)
        return args

    def rope_dims(self) -> tuple[int, int]:
        """The RoPE'd features of the global layers and of the sliding ones (the first
        sliding layer's: a layer type has one RoPE)."""
        sliding = [i for i, kind in enumerate(self.layer_types) if kind == SLIDING]
        local = self.layer_args(sliding[0]) if sliding else self
        return self.qk_rope_head_dim, local.qk_rope_head_dim

    def indexed(self, layer: int) -> bool:
        return self.layer_types[layer] == INDEXED

    @property
    def indexer_rope_pairs(self) -> bool:
        return True

    def layer_cache_width(self, layer: int) -> int:
        """The cached latent's width: kv_lora_rank + qk_rope_head_dim, and the indexer's
        key in an indexed layer."""
        args = self.layer_args(layer)
        index = self.index_head_dim if self.indexed(layer) else 0
        return args.kv_lora_rank + args.qk_rope_head_dim + index

    def cache_shapes(self) -> list[tuple[int, int]]:
        """Each layer's cached (heads, width): one latent head of its own width."""
        return [(1, self.layer_cache_width(i)) for i in range(self.num_hidden_layers)]

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window if kind == SLIDING else None for kind in self.layer_types]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = transformers_names(config)
        rope = config["rope_parameters"]
        global_kinds = {kind for kind in config["layer_types"] if kind != SLIDING} or {INDEXED}
        global_ropes = [rope[kind] for kind in sorted(global_kinds)]
        if any(params != global_ropes[0] for params in global_ropes):
            raise UnsupportedError(
                "Dots 3 Note with full and indexed layers of different RoPE is not supported"
            )
        values = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_theta")}
        values["rope_parameters"] = _rope(global_ropes[0])
        args = args_from_config(cls, values, nullable=("q_lora_rank", "n_shared_experts"))
        args.local_rope_parameters = _rope(rope.get(SLIDING, global_ropes[0]))
        return args


def _rope(params: dict[str, Any]) -> dict[str, Any]:
    """A layer type's RoPE as base.RotaryEmbedding takes it over qk_rope_head_dim
    features (transformers' partial_rotary_factor is qk_rope_head_dim / head_dim)."""
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    params = rope_parameters({"rope_parameters": params})
    if params["rope_type"] != "default":
        raise UnsupportedError(
            f"Dots 3 Note with RoPE type {params['rope_type']!r} is not supported (default)"
        )
    return params


class ScaledRMSNorm(RMSNorm):
    """RMSNorm times a constant: Dots 3 Note's latents scaled by sqrt(hidden / rank)."""

    def __init__(self, dim: int, eps: float, scale: float) -> None:
        super().__init__(dim, eps)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class Attention(deepseek_v32.Attention):
    """MLA in the layer's own shapes: indexed (DeepSeek sparse attention), sliding or
    full; scaled latents, a normalized rope key and a sigmoid gate per head."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        own = args.layer_args(layer)
        super().__init__(own, layer)
        self.layer_type = args.layer_types[layer]
        hidden, eps = args.hidden_size, args.rms_norm_eps
        if args.lora_rescale:
            q_rank, kv_rank = own.q_lora_rank, own.kv_lora_rank
            self.q_a_layernorm = ScaledRMSNorm(q_rank, eps, math.sqrt(hidden / q_rank))
            self.kv_a_layernorm = ScaledRMSNorm(kv_rank, eps, math.sqrt(hidden / kv_rank))
        self.k_rope_only_layernorm = RMSNorm(own.qk_rope_head_dim, eps)
        self.g_proj = nn.Linear(hidden, own.num_attention_heads, bias=False)

    def forward(
        self, x: torch.Tensor, frames: dict[str, IndexedFrame], cache: KVCache | None
    ) -> torch.Tensor:
        return super().forward(x, frames[self.layer_type], cache)

    def rope_key(self, k_rope: torch.Tensor) -> torch.Tensor:
        return self.k_rope_only_layernorm(k_rope)

    def gated_output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # [B, T, H*v] -> [B, T, H, v]: one gate a head
        heads = out.view(*out.shape[:-1], self.n_heads, -1)
        return (heads * torch.sigmoid(self.g_proj(x))[..., None]).view(out.shape)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        frame: IndexedFrame,
        cache: KVCache | None,
        x: torch.Tensor,
        q_resid: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.indexer is None:  # a sliding or full layer: every key its mask lets it see
            return deepseek_v2.Attention.attend(self, q, k, frame, cache, x, q_resid)
        return super().attend(q, k, frame, cache, x, q_resid)


class MoE(deepseek_v3.MoE):
    """DeepSeek-V3's experts; the shared ones shared_experts_intermediate_size wide."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        # deepseek_v2's MoE makes them moe_intermediate_size wide: replaced.
        width = args.shared_experts_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args, width)


class Layer(deepseek_v3.Layer):
    moe = MoE


class Model(deepseek_v32.Model):
    attention = Attention
    layer = Layer

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.model.rotary_emb_local = RotaryEmbedding(
            args.local_rope_parameters, args.rope_dims()[1], args.max_position_embeddings
        )

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, IndexedFrame]:
        """A frame per layer type, each with its RoPE: the global layers' (one, which
        the indexed layers' indexers fill) sees every earlier token, the sliding
        layers' the last sliding_window (in a cache that keeps only those: its plan)."""
        frames = layer_frames(
            positions,
            cache,
            dtype,
            self.args.sliding_window,
            self.model.rotary_emb,
            self.model.rotary_emb_local,
            last=last,
        )
        full = frames["full_attention"]
        full = IndexedFrame(**{f.name: getattr(full, f.name) for f in dataclasses.fields(full)})
        return {FULL: full, INDEXED: full, SLIDING: frames["sliding_attention"]}

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """A KV cache of each layer's latent in its own width (ModelArgs.cache_shapes)."""
        args = self.args
        shapes = args.cache_shapes()
        return KVCache(
            args.num_hidden_layers,
            batch,
            1,
            max_seq_len,
            shapes[0][1],
            dtype,
            device,
            windows=args.layer_windows(),
            values_are_keys=True,
            shapes=shapes,
        )
