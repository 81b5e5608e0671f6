"""MiMo-V2-Flash (Xiaomi; llama.cpp's "mimo2" GGUFs): sliding-window layers mixed with
global ones (by default the first and every sixth), each type with a RoPE base of its
own, rotating the first partial_rotary_factor (0.334) of each head's features; queries
and keys of head_dim (192), values of v_head_dim (128) scaled by attention_value_scale
(None: 1); the sliding layers with twice the key/value heads and an attention sink per
head (a learned logit in each softmax's denominator); pre-norm blocks whose
feed-forward is dense in the first layer (mlp_layer_types) and DeepSeek-V3's experts
after it, without shared experts: sigmoid scores, chosen by score +
e_score_correction_bias among the topk_group best of n_group groups, weighted by the
unbiased scores (renormalized with norm_topk_prob) times routed_scaling_factor.

Each layer is cached with its own key/value heads (cache_shapes: the global layers'
num_key_value_heads, the sliding layers' twice as many), as llama.cpp caches it. The
values are padded with zeros to head_dim, since the cache stores keys and values of one
width; the zeros add nothing to the outputs and are cut from them.

Xiaomi's own config.json names (hybrid_layer_pattern, moe_layer_freq, swa_*,
sliding_window_size, layernorm_epsilon, add_*_attention_sink_bias, a flat rope_theta)
are read where transformers' names are absent, as transformers' defaults spell the
released model; a value transformers' model cannot be is refused. The checkpoints'
multi-token-prediction layers (model.mtp.*) are skipped, as transformers skips them.

Reference: transformers/models/mimo_v2_flash/modeling_mimo_v2_flash.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v3
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    LayerTypes,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    check_layer_types,
    rope_parameters,
    sliding_windows,
)
from llmrun.models.cache import KVCache
from llmrun.models.gpt_oss import attend_with_sinks

SCORING = "sigmoid"
MLP_TYPES = ("dense", "sparse")
LAYER_TYPES = ("full_attention", "sliding_attention")
# MiMoV2FlashConfig's RoPE where a config gives none, and the rotated share of a head.
PARTIAL_ROTARY_FACTOR = 0.334
DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
SWA_KV_FACTOR = 2  # a sliding layer's key/value heads per global layer's


@dataclass
class ModelArgs:
    # MiMoV2FlashConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 16384  # the dense layers'
    moe_intermediate_size: int = 2048
    num_key_value_heads: int = 4  # the global layers'; sliding ones have twice as many
    head_dim: int = 192
    v_head_dim: int = 128
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int = 129
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    attention_value_scale: float | None = 0.707
    # The global layers' RoPE (the Body's), and the sliding layers'.
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    local_rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                for i in range(layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, layers)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] + ["sparse"] * (layers - 1)
        if len(self.mlp_layer_types) != layers or set(self.mlp_layer_types) - set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types is {self.mlp_layer_types!r}: one of {', '.join(MLP_TYPES)} "
                f"for each of the {layers} layers"
            )
        if self.v_head_dim > self.head_dim:
            raise UnsupportedError(
                f"MiMo-V2-Flash with v_head_dim {self.v_head_dim} wider than head_dim "
                f"{self.head_dim} is not supported"
            )
        if self.attention_value_scale is None:
            self.attention_value_scale = 1.0
        experts, groups = self.n_routed_experts, self.n_group
        if groups < 1 or experts % groups:
            raise ModelFormatError(f"{experts} experts do not split into n_group {groups} groups")
        if groups > 1 and experts // groups < 2:
            raise UnsupportedError(
                "MiMo-V2-Flash groups of one expert are not supported (a group scores its best two)"
            )
        if not 0 < self.topk_group <= groups:
            raise ModelFormatError(f"topk_group is {self.topk_group}, but n_group is {groups}")
        if not 0 < self.num_experts_per_tok <= experts // groups * self.topk_group:
            raise ModelFormatError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, but a token can reach "
                f"{experts // groups * self.topk_group} of the {experts} experts"
            )

    # What deepseek_v3's router and experts read: no shared experts.
    scoring_func = SCORING
    group_score = "top2"
    n_shared_experts = None

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return self.mlp_layer_types[layer] == "sparse"

    def layer_kv_heads(self, layer: int) -> int:
        sliding = self.layer_types[layer] == "sliding_attention"
        return self.num_key_value_heads * (SWA_KV_FACTOR if sliding else 1)

    def cache_shapes(self) -> list[tuple[int, int]]:
        """Each layer's cached (key/value heads, head width): its own heads, values
        padded to the keys' head_dim."""
        return [(self.layer_kv_heads(i), self.head_dim) for i in range(self.num_hidden_layers)]

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = _transformers_names(config)
        # attention_value_scale: null is no scaling, not the default 0.707.
        args = args_from_config(cls, config, nullable=("attention_value_scale",))
        rope = config.get("rope_parameters") or DEFAULT_ROPE
        if not isinstance(rope, dict) or set(rope) != set(LAYER_TYPES):
            raise ModelFormatError(
                f"rope_parameters is {rope!r}; MiMo-V2-Flash gives one for each of "
                f"{', '.join(LAYER_TYPES)}"
            )
        full, local = (
            {"partial_rotary_factor": PARTIAL_ROTARY_FACTOR, **rope[kind]} for kind in LAYER_TYPES
        )
        args.rope_parameters = rope_parameters({"rope_parameters": full, **_lengths(config)})
        args.local_rope_parameters = rope_parameters({"rope_parameters": local, **_lengths(config)})
        return args


def _lengths(config: dict[str, Any]) -> dict[str, Any]:
    """The config's fields base.rope_parameters reads beside the RoPE settings."""
    return {k: config[k] for k in ("max_position_embeddings",) if k in config}


def _transformers_names(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with Xiaomi's own field names turned into transformers', where those are
    absent; refused where Xiaomi's fields describe a model transformers' cannot be."""
    config = dict(config)
    pattern = config.get("hybrid_layer_pattern")
    if pattern is not None and config.get("layer_types") is None:
        config["layer_types"] = [LAYER_TYPES[1] if p else LAYER_TYPES[0] for p in pattern]
    moe = config.get("moe_layer_freq")
    if moe is not None and config.get("mlp_layer_types") is None:
        if not isinstance(moe, list):
            raise UnsupportedError(f"moe_layer_freq {moe!r} is not supported (a list of 0 and 1)")
        config["mlp_layer_types"] = [MLP_TYPES[1] if m else MLP_TYPES[0] for m in moe]
    if config.get("sliding_window_size") is not None:
        config["sliding_window"] = config["sliding_window_size"] + 1  # as transformers reads it
    if "rms_norm_eps" not in config and "layernorm_epsilon" in config:
        config["rms_norm_eps"] = config["layernorm_epsilon"]
    if config.get("rope_parameters") is None and "rope_theta" in config:
        factor = config.get("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
        thetas = (config["rope_theta"], config.get("swa_rope_theta", config["rope_theta"]))
        config["rope_parameters"] = {
            kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
            for kind, theta in zip(LAYER_TYPES, thetas, strict=True)
        }
    kv = config.get("num_key_value_heads", 4)
    expected = {
        "swa_num_key_value_heads": kv * SWA_KV_FACTOR,
        "swa_num_attention_heads": config.get("num_attention_heads"),
        "swa_head_dim": config.get("head_dim", 192),
        "swa_v_head_dim": config.get("v_head_dim", 128),
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "n_shared_experts": None,
        "scoring_func": SCORING,
        "topk_method": "noaux_tc",
    }
    for name, value in expected.items():
        if (
            name in config
            and config[name] != value
            and not (name == "n_shared_experts" and config[name] == 0)
        ):
            raise UnsupportedError(
                f"MiMo-V2-Flash with {name} {config[name]!r} is not supported (transformers' "
                f"model has {value!r}: sliding layers with twice the global layers' key/value "
                "heads, the same head sizes and attention sinks; sigmoid routing without "
                "shared experts)"
            )
    return config


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads = layer, args.num_attention_heads
        self.n_kv_heads = args.layer_kv_heads(layer)
        self.head_dim, self.v_head_dim = args.head_dim, args.v_head_dim
        self.layer_type = args.layer_types[layer]
        self.scale, self.v_scale = args.head_dim**-0.5, args.attention_value_scale
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.v_head_dim, dim, bias=False)
        sliding = self.layer_type == "sliding_attention"
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if sliding else None

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.v_head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        v = self.padded(v * self.v_scale)
        if self.sinks is None:
            out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale)
        else:
            out = attend_with_sinks(q, k, v, self.layer, frame, cache, self.scale, self.sinks)
        return self.o_proj(self.narrowed(out))

    def padded(self, v: torch.Tensor) -> torch.Tensor:
        """Values [B, Hkv, T, v_head_dim] as wide as the keys (the cache's one width)."""
        if self.v_head_dim == self.head_dim:
            return v
        return F.pad(v, (0, self.head_dim - self.v_head_dim))

    def narrowed(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [B, T, H * head_dim] without the values' padding."""
        if self.v_head_dim == self.head_dim:
            return out
        batch, tokens, _ = out.shape
        out = out.view(batch, tokens, self.n_heads, self.head_dim)[..., : self.v_head_dim]
        return out.reshape(batch, tokens, self.n_heads * self.v_head_dim)


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, deepseek_v3.Layer)
        self.model.rotary_emb_local = RotaryEmbedding(
            args.local_rope_parameters, args.head_dim, args.max_position_embeddings
        )

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """A KV cache of each layer in its own shape (ModelArgs.cache_shapes)."""
        args = self.args
        shapes = args.cache_shapes()
        heads, head_dim = shapes[0]
        return KVCache(
            args.num_hidden_layers,
            batch,
            heads,
            max_seq_len,
            head_dim,
            dtype,
            device,
            windows=args.layer_windows(),
            shapes=shapes,
        )
