"""Gemma 4 (text: E2B, E4B, 26B-A4B, 31B, Unified 12B; of a multimodal checkpoint, its
language model): Gemma 3's local/global layers with four norms each and q/k norms, and

- head sizes of their own: global layers have global_head_dim-wide heads (and, where
  keys are values, num_global_key_value_heads of them), local layers head_dim-wide ones;
- RoPE per layer type: local layers the default with their base, global ones
  "proportional" RoPE: the first partial_rotary_factor of the frequencies a full-width
  RoPE would have, the rest not turned (pairs i, i + head_dim / 2 as ever);
- values normalized without a scale, attention scores unscaled (the q/k norms set their
  size), and in global layers with attention_k_eq_v the values taken from the keys'
  projection (before the key norm and RoPE);
- KV sharing (as Gemma 3n): the last num_kv_shared_layers attend to the keys and values
  of the last earlier layer of their type, and with use_double_wide_mlp have feed-forwards
  twice as wide;
- per-layer embeddings (E2B, E4B; Gemma 3n's): a small vector per token and layer, gated
  into the residual after the layer;
- each layer's output scaled by its layer_scalar;
- with enable_moe_block (26B-A4B) experts beside the dense feed-forward: a router on the
  layer's input (normalized, scaled per feature and by hidden^-0.5), softmax top-k
  renormalized and scaled per expert, its own pre-norm and post-norms;
- norms x / rms(x) * w (not Gemma 3's 1 + w), logits soft-capped where the config says.

The KV cache holds each layer's keys and values in the layer's own shape (KV heads,
head width), as llama.cpp's does (KVCache's `shapes`).

Reference: transformers/models/gemma4/modeling_gemma4.py (Gemma4ForCausalLM, and
Gemma4ForConditionalGeneration's language model) and configuration_gemma4.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import gemma3n
from llmrun.models.base import (
    Frame,
    RotaryEmbedding,
    activation,
    args_from_config,
    check_layer_types,
    layer_frames,
    mix_experts,
)
from llmrun.models.cache import KVCache
from llmrun.models.gemma3 import ImageTokens
from llmrun.models.gemma3n import RMSNorm, kv_sources, per_layer_inputs, scale_like
from llmrun.models.qwen2_moe import MLP

SLIDING, FULL = "sliding_attention", "full_attention"
GLOBAL_EVERY = 6  # transformers' default layer_types: every sixth layer global
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default global_head_dim
# Gemma4TextConfig's RoPE when the config gives none.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what per_layer_config may set
UNIFIED_TEXT = "gemma4_unified_text"  # Gemma 4 Unified's language model (Gemma 4's)


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int | list[int]
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 256
    global_head_dim: int = GLOBAL_HEAD_DIM
    num_global_key_value_heads: int | None = None
    # transformers 5.25's saved form of the per-layer head sizes: {layer: {field: value}}.
    per_layer_config: dict[str, dict[str, int]] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    sliding_window: int | None = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    pad_token_id: int = 0  # what an image's soft tokens embed as before they are placed
    vocab_size_per_layer_input: int = 262144
    hidden_size_per_layer_input: int | None = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # global layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.use_bidirectional_attention == "all":
            raise UnsupportedError(
                "Gemma 4 with use_bidirectional_attention='all' is not supported (text "
                "generation is causal)"
            )
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.hidden_act = self.hidden_activation  # the name MLP reads
        activation(self.hidden_act)  # refused here when unknown
        if self.layer_types is None:
            self.layer_types = [SLIDING if (i + 1) % GLOBAL_EVERY else FULL for i in range(layers)]
        self.layer_types = check_layer_types(self.layer_types, layers)
        # transformers forces the last layer global (Gemma4TextConfig.__post_init__).
        self.layer_types[-1] = FULL
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelFormatError("sliding_attention layers need a sliding_window")
        self.kv_sources = kv_sources(self.layer_types, self.num_kv_shared_layers)
        self.layer_head_dims, self.layer_kv_heads = self._layer_shapes()
        for heads in set(self.layer_kv_heads):
            if self.num_attention_heads % heads:
                raise UnsupportedError(
                    f"Gemma 4 layers with {heads} key/value heads and "
                    f"{self.num_attention_heads} query heads: each key/value head must "
                    "serve the same number of query heads"
                )
        self.intermediate_sizes = self._widths()
        if self.enable_moe_block and not (
            self.num_experts and self.top_k_experts and self.moe_intermediate_size
        ):
            raise ModelFormatError(
                "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # A multimodal (Gemma4ForConditionalGeneration) config: its language model.
        config = config.get("text_config") or config
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        if config.get("model_type") == UNIFIED_TEXT:
            # Gemma4UnifiedTextConfig has neither per-layer inputs nor experts.
            flat.update(hidden_size_per_layer_input=None, enable_moe_block=False)
        nullable = ("final_logit_softcapping", "hidden_size_per_layer_input",
                    "num_global_key_value_heads", "use_bidirectional_attention")  # fmt: skip
        args = args_from_config(cls, flat, nullable=nullable)
        ropes = {**DEFAULT_ROPE, **(config.get("rope_parameters") or {})}
        args.rope_local_parameters = _local_rope(ropes[SLIDING])
        args.rope_parameters = proportional_rope(ropes[FULL], args.head_dim_of(FULL))
        return args

    def head_dim_of(self, kind: str) -> int:
        """The head width of the layers of a type (one for all of them; the last layer is
        always global), which its RoPE table turns."""
        dims = {d for d, t in zip(self.layer_head_dims, self.layer_types, strict=True) if t == kind}
        return dims.pop() if dims else self.head_dim

    def _layer_shapes(self) -> tuple[list[int], list[int]]:
        """Each layer's head width and KV heads: local layers head_dim and
        num_key_value_heads, global ones global_head_dim and (keys as values only)
        num_global_key_value_heads, as transformers' Gemma4TextConfig overrides them; or
        per_layer_config's, where the config has it (which transformers then takes
        instead). One shape per layer type."""
        layers = self.num_hidden_layers
        dims = [self.head_dim] * layers
        heads = [self.num_key_value_heads] * layers
        if self.per_layer_config is None:
            global_heads = self.num_key_value_heads
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                global_heads = self.num_global_key_value_heads
            for i, kind in enumerate(self.layer_types):
                if kind == FULL:
                    dims[i], heads[i] = self.global_head_dim, global_heads
        else:
            for index, overrides in self.per_layer_config.items():
                i = int(index)
                unknown = set(overrides) - set(LAYER_OVERRIDES)
                if not 0 <= i < layers or unknown:
                    raise UnsupportedError(
                        f"per_layer_config[{index!r}] sets {sorted(overrides)}; llmrun "
                        f"supports {', '.join(LAYER_OVERRIDES)} of layers 0..{layers - 1}"
                    )
                dims[i] = overrides.get("head_dim", dims[i])
                heads[i] = overrides.get("num_key_value_heads", heads[i])
        for kind in (SLIDING, FULL):
            shapes = {(d, h) for d, h, t in zip(dims, heads, self.layer_types, strict=True)
                      if t == kind}  # fmt: skip
            if len(shapes) > 1:
                raise UnsupportedError(
                    f"Gemma 4 {kind} layers of different head shapes {sorted(shapes)} are not "
                    "supported (one RoPE table per layer type)"
                )
        return dims, heads

    def _widths(self) -> list[int]:
        """Each layer's feed-forward width: the sharing layers' doubled with
        use_double_wide_mlp; a list (a GGUF's) as it is."""
        layers = self.num_hidden_layers
        if isinstance(self.intermediate_size, list):
            if len(self.intermediate_size) != layers:
                raise ModelFormatError(
                    f"intermediate_size lists {len(self.intermediate_size)} layers, but "
                    f"num_hidden_layers is {layers}"
                )
            return list(self.intermediate_size)
        wide = 2 if self.use_double_wide_mlp else 1
        return [
            self.intermediate_size * (wide if i >= self.kv_layers else 1) for i in range(layers)
        ]

    @property
    def kv_layers(self) -> int:
        """The layers that compute (and cache) keys and values: all but the sharing ones."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def has_per_layer_inputs(self) -> bool:
        return bool(self.hidden_size_per_layer_input)

    def cache_shapes(self) -> list[tuple[int, int]]:
        """Each KV cache layer's (KV heads, head width): the layers' own."""
        return list(zip(self.layer_kv_heads, self.layer_head_dims, strict=True))[: self.kv_layers]

    def layer_windows(self) -> list[int | None]:
        """Each KV cache layer's sliding window, None for global layers."""
        return [
            self.sliding_window if kind == SLIDING else None
            for kind in self.layer_types[: self.kv_layers]
        ]


def _local_rope(params: dict[str, Any]) -> dict[str, Any]:
    """The local layers' RoPE: the default, turning the whole head."""
    if params.get("rope_type", "default") != "default":
        raise UnsupportedError(
            f"Gemma 4 sliding_attention RoPE type {params['rope_type']!r} is not supported "
            "(default is)"
        )
    return {"rope_type": "default", "rope_theta": params.get("rope_theta", 10_000.0)}


def proportional_rope(params: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The global layers' RoPE as RotaryEmbedding takes it: "proportional" (or "default",
    every frequency turning) over the whole head_dim, its first int(partial_rotary_factor *
    head_dim // 2) frequencies base^(-2i / head_dim) / factor and the rest 0 (divided by
    infinity), as transformers' _compute_proportional_rope_parameters gives them."""
    kind = params.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise UnsupportedError(
            f"Gemma 4 full_attention RoPE type {kind!r} is not supported (proportional, "
            "default are)"
        )
    turned = head_dim // 2
    factor = 1.0
    if kind == "proportional":
        turned = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        factor = params.get("factor", 1.0)
    still = head_dim // 2 - turned
    return {
        "rope_type": "default",
        "rope_theta": params.get("rope_theta", 10_000.0),
        "freq_factors": [factor] * turned + [math.inf] * still,
    }


class GlobalBothWays:
    """Marks image tokens (an ImageTokens subclass) that see each other both ways on
    global layers too, not on sliding ones alone: Gemma 4 Unified's (transformers'
    Gemma4UnifiedModel masks every layer by its image blocks; llama.cpp decodes a
    gemma4uv image batch non-causally)."""


class Attention(gemma3n.Attention):
    """Gemma 3n's attention in each layer's own head size and KV heads, global layers
    with attention_k_eq_v taking their values from the keys' projection."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        own_values = not (args.attention_k_eq_v and args.layer_types[layer] == FULL)
        head_dim, kv_heads = args.layer_head_dims[layer], args.layer_kv_heads[layer]
        super().__init__(args, layer, head_dim, kv_heads, own_values)


class Router(nn.Module):
    """The experts of each token: softmax over proj(norm(x) * scale / sqrt(hidden)),
    the top_k renormalized, each weighed by its expert's per_expert_scale."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.root = args.top_k_experts, args.hidden_size**-0.5
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(args.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> f32 weights [N, top_k] and expert indices [N, top_k]."""
        logits = self.proj(self.norm(x) * self.scale * self.root)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[indices], indices


class DecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ffw_norm(ffw), ffw the dense
    feed-forward of pre_ffw_norm(x) (with experts: plus the experts', each post-normed),
    then the per-layer input gated in, all times layer_scalar."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args, args.intermediate_sizes[layer])
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.router = self.experts = None
        if args.enable_moe_block:
            self.router = Router(args)
            self.experts = nn.ModuleList(
                MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
            )
            self.post_feedforward_layernorm_1 = RMSNorm(dim, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(dim, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(dim, eps)
        self.per_layer_input_gate = None
        if args.has_per_layer_inputs:
            width = args.hidden_size_per_layer_input
            self.act = activation(args.hidden_act)
            self.per_layer_input_gate = nn.Linear(dim, width, bias=False)
            self.per_layer_projection = nn.Linear(width, dim, bias=False)
            self.post_per_layer_input_norm = RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        frames: dict[str, Frame],
        cache: KVCache | None,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """x [B, T, hidden] and this layer's input [B, T, per-layer width] -> x."""
        attn = self.self_attn(self.input_layernorm(x), frames, cache, shared)
        x = x + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(
                self.expert_mix(x)
            )
        x = x + self.post_feedforward_layernorm(out)
        if self.per_layer_input_gate is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar.to(x.dtype)

    def expert_mix(self, x: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum for x [B, T, hidden] (the layer's input to the
        feed-forward, before its norms): routed on x, run on pre_ffw_norm_2(x)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.router(flat)
        normed = self.pre_feedforward_layernorm_2(flat)
        return mix_experts(normed, weights.to(x.dtype), indices, self.experts).view_as(x)


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, layers = args.hidden_size, args.num_hidden_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, dim)
        if args.has_per_layer_inputs:
            per_layer = layers * args.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, per_layer)
            self.per_layer_model_projection = nn.Linear(dim, per_layer, bias=False)
            self.per_layer_projection_norm = RMSNorm(
                args.hidden_size_per_layer_input, args.rms_norm_eps
            )
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(layers))
        self.norm = RMSNorm(dim, args.rms_norm_eps)
        positions = args.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(args.rope_parameters, args.head_dim_of(FULL), positions)
        self.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim_of(SLIDING), positions
        )


class Model(nn.Module):
    """embed * sqrt(hidden) -> decoder layers (each with its per-layer input) -> norm ->
    lm_head (-> soft-cap), with HF's module names."""

    decode_step = None  # the native step knows none of this: never attached (FAMILIES)

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
        images: ImageTokens | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T];
        [B, 1, vocab] with last_only or `last` (as CausalLM.forward). `images`: the image
        soft tokens in place of their placeholders (one row), which embed as padding
        before they are placed (so their per-layer inputs are the pad token's, plus the
        projection of the image's embeddings), and with use_bidirectional_attention
        "vision" see each other both ways on sliding layers (Gemma4Model.forward; on every
        layer where they are GlobalBothWays)."""
        body, args = self.model, self.args
        if images is not None:
            if not 0 <= args.pad_token_id < args.vocab_size:
                raise ModelFormatError(
                    f"pad_token_id {args.pad_token_id} is not in the vocabulary of "
                    f"{args.vocab_size}: an image's tokens embed as it"
                )
            input_ids = input_ids.masked_fill(images.groups >= 0, args.pad_token_id)
        x = body.embed_tokens(input_ids)
        x = x * scale_like(args.hidden_size**0.5, x)
        if images is not None:
            x = images.place(x)
        per_layer = None
        if args.has_per_layer_inputs:
            per_layer = per_layer_inputs(body, args, input_ids, x)
        frames = layer_frames(
            positions,
            cache,
            x.dtype,
            args.sliding_window,
            body.rotary_emb,
            body.rotary_emb_local,
            last=last,
        )
        if images is not None and args.use_bidirectional_attention == "vision":
            # Global layers stay causal (create_masks_for_vision_model), but for images
            # that see each other both ways on them too (GlobalBothWays).
            both_ways = images.unmask(frames, args.sliding_window)
            if not isinstance(images, GlobalBothWays):
                both_ways = {**frames, SLIDING: both_ways[SLIDING]}
            frames = both_ways
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(body.layers):
            x = layer(x, None if per_layer is None else per_layer[:, :, i], frames, cache, shared)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        logits = self.lm_head(body.norm(x))
        cap = args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """A KV cache of the layers that compute keys and values (not the sharing ones),
        each in its own shape."""
        args = self.args
        shapes = args.cache_shapes()
        heads, head_dim = shapes[0]
        return KVCache(
            args.kv_layers,
            batch,
            heads,
            max_seq_len,
            head_dim,
            dtype,
            device,
            windows=args.layer_windows(),
            shapes=shapes,
        )
