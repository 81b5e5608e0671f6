"""Gemma 3n (E2B, E4B; text: of a multimodal checkpoint, its language model): Gemma 3's
local/global layers with their own RoPE bases, q/k norms and final soft-capping, and

- AltUp: the hidden state is altup_num_inputs streams; each layer predicts all of them
  from a learned mix, runs only the active one (altup_active_idx) through attention and
  the feed-forward, and corrects the others by what that changed;
- LAuReL: a low-rank (laurel_rank) branch beside attention, averaged into the residual;
- per-layer embeddings: a second embedding table gives every token a small vector per
  layer (plus a projection of its main embedding), gated into streams 1.. after the layer;
- KV sharing: the last num_kv_shared_layers layers compute no keys or values of their
  own; each attends to those of the last earlier layer of its type, so the KV cache holds
  only the layers before them;
- activation sparsity: the first layers' feed-forward keeps only the gate activations
  above mean + std * icdf(sparsity) (a Gaussian top-k);
- norms x / rms(x) * w (not Gemma's 1 + w), values normalized without a scale, and
  attention scores unscaled (the q/k norms set their size).

Reference: transformers/models/gemma3n/modeling_gemma3n.py (Gemma3nForCausalLM, and
Gemma3nForConditionalGeneration's language model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError
from llmrun.models.base import (
    Frame,
    RotaryEmbedding,
    activation,
    args_from_config,
    attend_paged,
    attention,
    cached_keys_values,
    layer_frames,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache
from llmrun.models.gemma3 import ImageTokens, rope_by_layer_type

GLOBAL_EVERY = 5  # transformers' default layer_types: every fifth layer global
SPARSE_LAYERS, SPARSITY = 10, 0.95  # its default activation_sparsity_pattern


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int | list[int]
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    sliding_window: int | None = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    vocab_size_per_layer_input: int = 262144
    hidden_size_per_layer_input: int = 256
    altup_active_idx: int = 0
    altup_correct_scale: bool = True
    altup_num_inputs: int = 4
    num_kv_shared_layers: int = 15
    laurel_rank: int = 64
    activation_sparsity_pattern: float | list[float] | None = None
    # llmrun's own: the cutoffs' std multipliers as llama.cpp's GGUFs store them
    # (icdf(sparsity); -inf for a dense layer), taken over activation_sparsity_pattern.
    activation_sparsity_std_multipliers: list[float] | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # global layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.hidden_act = self.hidden_activation
        activation(self.hidden_act)  # refused here when unknown
        if isinstance(self.intermediate_size, int):
            self.intermediate_size = [self.intermediate_size] * layers
        if len(self.intermediate_size) != layers:
            raise ModelFormatError(
                f"intermediate_size lists {len(self.intermediate_size)} layers, but "
                f"num_hidden_layers is {layers}"
            )
        self.layer_types = windowed_layer_types(
            self.layer_types, layers, self.sliding_window, GLOBAL_EVERY
        )
        if not 0 <= self.altup_active_idx < self.altup_num_inputs:
            raise ModelFormatError(
                f"altup_active_idx {self.altup_active_idx} is not one of the "
                f"{self.altup_num_inputs} AltUp streams"
            )
        self.std_multipliers = self._std_multipliers()
        self.kv_sources = kv_sources(self.layer_types, self.num_kv_shared_layers)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # A multimodal (Gemma3nForConditionalGeneration) config: its language model.
        config = config.get("text_config") or config
        ropes = rope_by_layer_type(config)
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        args = args_from_config(cls, flat, nullable=("final_logit_softcapping",))
        args.rope_parameters = ropes["full_attention"]
        args.rope_local_parameters = ropes["sliding_attention"]
        return args

    def _std_multipliers(self) -> list[float | None]:
        """Each layer's Gaussian top-k cutoff in standard deviations, None where dense."""
        layers = self.num_hidden_layers
        if self.activation_sparsity_std_multipliers is not None:
            given = list(self.activation_sparsity_std_multipliers)
            if len(given) != layers:
                raise ModelFormatError(
                    f"{len(given)} activation sparsity scales for {layers} layers"
                )
            return [m if math.isfinite(m) else None for m in given]
        pattern = self.activation_sparsity_pattern
        if pattern is None:
            sparse = SPARSE_LAYERS if layers > SPARSE_LAYERS else 0
            pattern = [SPARSITY] * sparse + [0.0] * (layers - sparse)
        elif not isinstance(pattern, list):
            pattern = [pattern] * layers
        if len(pattern) != layers:
            raise ModelFormatError(
                f"activation_sparsity_pattern lists {len(pattern)} layers, but "
                f"num_hidden_layers is {layers}"
            )
        normal = torch.distributions.Normal(0.0, 1.0)
        # As transformers computes it: the f32 inverse CDF of the sparsity.
        return [
            normal.icdf(torch.tensor(s, dtype=torch.float32)).item() if s > 0 else None
            for s in pattern
        ]

    @property
    def kv_layers(self) -> int:
        """The layers that compute (and cache) keys and values: all but the sharing ones."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def layer_windows(self) -> list[int | None]:
        """Each KV cache layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types[: self.kv_layers], self.sliding_window)


def kv_sources(layer_types: list[str], shared: int) -> list[int]:
    """The layer whose keys and values each layer attends to: its own, or for the last
    `shared` layers the last earlier layer of its type (Gemma 3n's and Gemma 4's KV
    sharing)."""
    layers = len(layer_types)
    if not 0 <= shared < layers:
        raise ModelFormatError(
            f"num_kv_shared_layers is {shared}; the model has {layers} layers, and at "
            "least the first must compute its keys and values"
        )
    first = layers - shared
    sources = list(range(first))
    for i in range(first, layers):
        own = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not own:
            raise ModelFormatError(
                f"layer {i} ({layer_types[i]}) shares the keys and values of an "
                f"earlier layer of its type, but layers 0..{first - 1} have none"
            )
        sources.append(own[-1])
    return sources


class RMSNorm(nn.Module):
    """x / rms(x) * w in float32, cast back (Gemma3nRMSNorm: w itself, not 1 + w); the
    values' norm has no w."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).type_as(x)
        return ops.rms_norm(x.float(), self.weight.float(), self.eps).type_as(x)


def scale_like(value: float, x: torch.Tensor) -> torch.Tensor:
    """A constant as transformers keeps it: an f32 tensor rounded to x's dtype."""
    return torch.tensor(value, dtype=torch.float32).to(x.dtype)


class Attention(nn.Module):
    """q/k/v norms, unscaled scores, and the last layers attending to an earlier layer's
    keys and values. Gemma 4's too: each layer's own `head_dim` and `kv_heads`, and
    without `own_values` the values taken from the keys' projection."""

    def __init__(
        self,
        args: Any,
        layer: int,
        head_dim: int | None = None,
        kv_heads: int | None = None,
        own_values: bool = True,
    ) -> None:
        super().__init__()
        self.layer, self.source = layer, args.kv_sources[layer]
        self.read_later = layer in args.kv_sources[args.kv_layers :]  # by a sharing layer
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = kv_heads or args.num_key_value_heads
        self.head_dim, self.layer_type = head_dim or args.head_dim, args.layer_types[layer]
        dim, width, bias = args.hidden_size, self.n_heads * self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(dim, width, bias=bias)
        self.o_proj = nn.Linear(width, dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.v_proj = None
        if self.source == layer:  # a sharing layer has no keys or values to compute
            kv_width = self.n_kv_heads * self.head_dim
            self.k_proj = nn.Linear(dim, kv_width, bias=bias)
            if own_values:
                self.v_proj = nn.Linear(dim, kv_width, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.v_norm = RMSNorm(self.head_dim, args.rms_norm_eps, with_scale=False)

    def forward(
        self,
        x: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. `shared`: this forward's keys and values
        by layer, which the sharing layers attend to (a paged cache: its blocks)."""
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        q = frame.rotate(q.transpose(1, 2))
        paged = cache is not None and cache.paged
        if self.source != self.layer:
            if paged:
                out = attend_paged(q, None, None, self.source, frame, cache, 1.0)
            else:
                keys, values = shared[self.source]
                out = attention(q, keys, values, frame.mask, 1.0)
            return self.o_proj(out)
        shape = (batch, tokens, self.n_kv_heads, self.head_dim)
        k = self.k_proj(x).view(shape)
        v = k if self.v_proj is None else self.v_proj(x).view(shape)
        k = frame.rotate(self.k_norm(k).transpose(1, 2))
        v = self.v_norm(v).transpose(1, 2)
        if paged:
            return self.o_proj(attend_paged(q, k, v, self.layer, frame, cache, 1.0))
        keys, values = cached_keys_values(k, v, self.layer, frame, cache, tokens)
        if self.read_later:
            shared[self.layer] = keys, values
        return self.o_proj(attention(q, keys, values, frame.mask, 1.0))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), its own width per layer; in a sparse layer the gate
    keeps only what exceeds mean + std * multiplier (the Gaussian top-k)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        dim, width = args.hidden_size, args.intermediate_size[layer]
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)
        self.act = activation(args.hidden_act)
        self.std_multiplier = args.std_multipliers[layer]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.std_multiplier is not None:
            mean = gate.mean(dim=-1, keepdim=True)
            std = gate.std(dim=-1, keepdim=True, unbiased=False)
            gate = F.relu(gate - (mean + std * scale_like(self.std_multiplier, gate)))
        return self.down_proj(ops.gated(self.act, gate, self.up_proj(x)))


class Laurel(nn.Module):
    """x + norm(right(left(x))): the low-rank residual branch."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.linear_left = nn.Linear(args.hidden_size, args.laurel_rank, bias=False)
        self.linear_right = nn.Linear(args.laurel_rank, args.hidden_size, bias=False)
        self.post_laurel_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class AltUp(nn.Module):
    """AltUp's predict and correct steps over the streams [n, B, T, hidden]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        n, dim = args.altup_num_inputs, args.hidden_size
        self.n, self.active = n, args.altup_active_idx
        self.correct_output_scale = nn.Parameter(torch.zeros(dim))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(dim, n, bias=False)
        self.router_norm = RMSNorm(dim, args.rms_norm_eps)
        self.router_scale = 1.0 / dim
        # altup_coef_clip clamps the coefficients in training only; inference (here and
        # in transformers' eval mode and llama.cpp) takes them as they are.

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """tanh(router(norm(x) / hidden)): [B, T, n]."""
        routed = self.modality_router(self.router_norm(x) * scale_like(self.router_scale, x))
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Each stream plus a mix of all of them, the mix [n, n] chosen per token."""
        modalities = self.modalities(streams[self.active])
        # [B, T, n * n] -> [B, T, n, n]: coefs[..., i, j] weighs stream j in prediction i
        coefs = self.prediction_coefs(modalities).unflatten(-1, (self.n, self.n))
        mixed = streams.permute(1, 2, 3, 0) @ coefs.transpose(-1, -2)  # [B, T, hidden, n]
        return (mixed.permute(3, 0, 1, 2) + streams).type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """The predictions moved by the active stream's innovation, scaled per stream."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0  # [B, T, n]
        innovation = activated - predictions[self.active]
        corrected = innovation[None] * coefs.permute(2, 0, 1)[..., None] + predictions
        return corrected.type_as(activated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The corrected active stream scaled by correct_output_scale."""
        return (x.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.active, self.correct_scale = args.altup_active_idx, args.altup_correct_scale
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args, layer)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.altup = AltUp(args)
        self.laurel = Laurel(args)
        self.per_layer_input_gate = nn.Linear(dim, args.hidden_size_per_layer_input, bias=False)
        self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, dim, bias=False)
        self.post_per_layer_input_norm = RMSNorm(dim, eps)
        self.act = activation(args.hidden_act)

    def forward(
        self,
        streams: torch.Tensor,
        per_layer_input: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """streams [n, B, T, hidden] and this layer's input [B, T, per-layer width] ->
        streams."""
        predictions = self.altup.predict(streams)
        active = predictions[self.active]
        normed = self.input_layernorm(active)
        attn = self.post_attention_layernorm(self.self_attn(normed, frames, cache, shared))
        x = (active + attn + self.laurel(normed)) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        gated = corrected[self.active]
        if self.correct_scale:
            gated = self.altup(gated)
        gated = self.act(self.per_layer_input_gate(gated)) * per_layer_input
        update = self.post_per_layer_input_norm(self.per_layer_projection(gated))
        # Streams 1.. take it, whichever is active (as transformers and llama.cpp add it).
        return torch.cat((corrected[:1], corrected[1:] + update))


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, layers = args.hidden_size, args.num_hidden_layers
        per_layer = layers * args.hidden_size_per_layer_input
        self.embed_tokens = nn.Embedding(args.vocab_size, dim)
        self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, per_layer)
        self.per_layer_model_projection = nn.Linear(dim, per_layer, bias=False)
        self.per_layer_projection_norm = RMSNorm(
            args.hidden_size_per_layer_input, args.rms_norm_eps
        )
        extra = args.altup_num_inputs - 1
        self.altup_projections = nn.ModuleList(
            nn.Linear(dim, dim, bias=False) for _ in range(extra)
        )
        self.altup_unembed_projections = nn.ModuleList(
            nn.Linear(dim, dim, bias=False) for _ in range(extra)
        )
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(layers))
        self.norm = RMSNorm(dim, args.rms_norm_eps)
        positions = args.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(args.rope_parameters, args.head_dim, positions)
        self.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, positions
        )


def rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x scaled to the root mean square `target` (its own floored at sqrt(1e-5))."""
    magnitude = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


def per_layer_inputs(body: nn.Module, args: Any, input_ids: torch.Tensor, x: torch.Tensor):
    """Each token's input to each layer [B, T, layers, width] (Gemma 3n's and Gemma 4's
    per-layer embeddings): its per-layer embedding (id 0's for ids past that table) plus
    the normalized projection of its embedding x [B, T, hidden], over sqrt(2). `body`
    holds the tables (HF names), `args` their sizes."""
    shape = (*input_ids.shape, args.num_hidden_layers, args.hidden_size_per_layer_input)
    in_table = (input_ids >= 0) & (input_ids < args.vocab_size_per_layer_input)
    embedded = body.embed_tokens_per_layer(torch.where(in_table, input_ids, 0))
    embedded = embedded * scale_like(args.hidden_size_per_layer_input**0.5, embedded)
    projected = body.per_layer_model_projection(x) * scale_like(args.hidden_size**-0.5, x)
    projected = body.per_layer_projection_norm(projected.view(shape))
    return (projected + embedded.view(shape)) * torch.rsqrt(torch.tensor(2.0)).to(x.dtype)


class Model(nn.Module):
    """embed * sqrt(hidden) -> AltUp streams -> decoder layers (each with its per-layer
    input) -> the streams merged -> norm -> lm_head -> soft-cap, with HF's module names."""

    decode_step = None  # the native step knows no AltUp: never attached (FAMILIES)

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
        [B, 1, vocab] with last_only or `last` (as CausalLM.forward). `images`: a clip's
        embeddings in place of its tokens (one row; they attend causally), whose per-layer
        inputs take the ids as they are (Gemma3nModel.forward)."""
        body, args = self.model, self.args
        x = body.embed_tokens(input_ids)
        x = x * scale_like(args.hidden_size**0.5, x)
        if images is not None:
            x = images.place(x)
        per_layer = self.per_layer_inputs(input_ids, x)
        frames = layer_frames(
            positions,
            cache,
            x.dtype,
            args.sliding_window,
            body.rotary_emb,
            body.rotary_emb_local,
            last=last,
        )
        streams = self.spread(x)
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(body.layers):
            streams = layer(streams, per_layer[:, :, i], frames, cache, shared)
        x = self.merge(streams)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        logits = self.lm_head(body.norm(x))
        cap = args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Each token's input to each layer [B, T, layers, width] (per_layer_inputs)."""
        return per_layer_inputs(self.model, self.args, input_ids, x)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> the AltUp streams [n, B, T, hidden]: x, and its projections
        at x's root mean square."""
        target = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5
        extra = [rescaled(p(x), target) for p in self.model.altup_projections]
        return torch.stack([x, *extra])

    def merge(self, streams: torch.Tensor) -> torch.Tensor:
        """The streams' mean, streams 1.. projected back at stream 0's root mean square."""
        target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        back = [
            rescaled(p(s), target)
            for p, s in zip(self.model.altup_unembed_projections, streams[1:], strict=True)
        ]
        return torch.mean(torch.stack([streams[0], *back]), dim=0)

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """A KV cache of the layers that compute keys and values (not the sharing ones)."""
        args = self.args
        return KVCache(
            args.kv_layers,
            batch,
            args.num_key_value_heads,
            max_seq_len,
            args.head_dim,
            dtype,
            device,
            windows=args.layer_windows(),
        )
