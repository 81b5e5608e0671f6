"""Llama 4 (text; Scout, Maverick): Llama whose RoPE layers turn adjacent pairs of
features, L2-normalize queries and keys (use_qk_norm) and attend only within chunks of
attention_chunk_size positions, while every fourth layer by default (no_rope_layers)
has no RoPE, attends to everything and scales its queries by an attention temperature
that grows with the position; feed-forwards are a top-k (k = 1) of experts plus a
shared expert, where a chosen expert's input (not its output) is scaled by the sigmoid
of its router logit, in every interleave_moe_layer_step-th layer (the others are dense,
intermediate_size_mlp wide).

Reference: transformers/models/llama4/modeling_llama4.py (Llama4ForCausalLM; of a
multimodal Llama4ForConditionalGeneration checkpoint, its language model). Parameter
names are the checkpoint's, except the experts: one module per expert
(`feed_forward.experts.N.gate_proj`, ...), as the loader splits the checkpoint's fused
gate_up_proj and down_proj.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    args_from_config,
    attention_mask,
    check_top_k,
    key_positions,
    mix_experts,
    rotate_pairs,
)
from llmrun.models.cache import KVCache

LAYER_TYPES = ("full_attention", "chunked_attention")
DEFAULT_THETA = 500000.0  # Llama4TextConfig's, for a config that gives no rope_theta


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # each expert's and the shared expert's
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size_mlp: int = 16384  # the dense layers'
    num_key_value_heads: int | None = None
    head_dim: int | None = 128  # null: hidden_size / num_attention_heads
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    moe_layers: list[int] | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    no_rope_layers: list[int] | None = None  # 1 where a layer rotates
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192  # null: no chunked layers
    layer_types: list[str] | None = None
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")
        if not self.no_rope_layers:  # transformers' default for a missing or empty list
            interval = _positive(self.no_rope_layer_interval, "no_rope_layer_interval")
            self.no_rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
        if len(self.no_rope_layers) < layers:
            raise ModelFormatError(
                f"no_rope_layers lists {len(self.no_rope_layers)} layers, but "
                f"num_hidden_layers is {layers}"
            )
        if self.moe_layers is None:
            step = _positive(self.interleave_moe_layer_step, "interleave_moe_layer_step")
            self.moe_layers = list(range(step - 1, layers, step))
        chunk = self.attention_chunk_size
        if self.layer_types is None:
            self.layer_types = [
                "chunked_attention" if rope and chunk is not None else "full_attention"
                for rope in self.no_rope_layers[:layers]
            ]
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise UnsupportedError(
                    f"Llama 4 layer type {kind!r} is not supported "
                    f"(supported: {', '.join(LAYER_TYPES)})"
                )
        if len(self.layer_types) != layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {layers}"
            )
        if "chunked_attention" in self.layer_types:
            self.attention_chunk_size = _positive(chunk, "attention_chunk_size")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # A multimodal (Llama4ForConditionalGeneration) config: its language model.
        config = config.get("text_config") or config
        config = {"rope_theta": DEFAULT_THETA, **config}
        return args_from_config(cls, config, nullable=("attention_chunk_size", "head_dim"))


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFormatError(f"{name} is {value!r}, not a positive whole number")
    return value


class Attention(llama.Attention):
    """Llama's attention with Llama 4's position handling: RoPE on adjacent pairs and
    then the weightless L2 norm on a RoPE layer; none and the temperature on a NoPE one."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.use_rope = bool(args.no_rope_layers[layer])
        self.norm_eps = args.rms_norm_eps if args.use_qk_norm and self.use_rope else None
        self.temperature = None
        if args.attn_temperature_tuning and not self.use_rope:
            self.temperature = (float(args.floor_scale), args.attn_scale)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        if not self.use_rope:
            return x
        # transformers turns (x[2i], x[2i+1]) as complex numbers; rotate_pairs leaves the
        # features in another order, the same for queries and keys, which the norm
        # (over the whole head) does not see.
        x = rotate_pairs(x, frame)
        if self.norm_eps is None:
            return x
        x32 = x.float()  # in float32, as transformers' Llama4TextL2Norm
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.norm_eps)).to(x.dtype)

    def scale_queries(self, q: torch.Tensor, frame: Frame) -> torch.Tensor:
        if self.temperature is None:
            return q
        floor_scale, attn_scale = self.temperature
        steps = torch.floor((frame.positions.float() + 1.0) / floor_scale)
        scale = torch.log1p(steps) * attn_scale + 1.0
        # [B, T] -> [B, 1, T, 1]; the product in float32, as transformers takes it
        return (q * scale[:, None, :, None]).to(q.dtype)


class MoE(nn.Module):
    """The shared expert plus, for each of the top_k router logits, its expert run on
    the input scaled by the logit's sigmoid."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(args) for _ in range(args.num_local_experts))
        self.shared_expert = GatedMLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [N, D]
        logits, indices = torch.topk(self.router(x2), self.top_k, dim=-1)
        scores = torch.sigmoid(logits.float()).to(x2.dtype)
        # Each (token, choice) pair is a row of its own: [N, k, D] -> [N * k, D], with
        # one expert of weight 1, so the experts see the scaled inputs.
        scaled = (x2[:, None] * scores[..., None]).reshape(-1, x2.shape[-1])
        ones = torch.ones(scaled.shape[0], 1, dtype=x2.dtype, device=x2.device)
        routed = mix_experts(scaled, ones, indices.reshape(-1, 1), self.experts)
        routed = routed.view(x2.shape[0], self.top_k, -1).sum(dim=1)
        return (self.shared_expert(x2) + routed).view(x.shape)


def feed_forward(args: ModelArgs, layer: int) -> nn.Module:
    """The layer's experts, or its dense feed-forward (intermediate_size_mlp wide)."""
    if layer in args.moe_layers:
        return MoE(args)
    return GatedMLP(dataclasses.replace(args, intermediate_size=args.intermediate_size_mlp))


class DecoderLayer(nn.Module):
    """Pre-norm residual block, attending through its layer type's Frame."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: Any) -> None:
        super().__init__()
        self.layer_type = args.layer_types[layer]
        self.self_attn = attention(args, layer)
        self.feed_forward = mlp(args, layer)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frames[self.layer_type], cache)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, feed_forward, DecoderLayer)

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per layer type: full layers see every earlier position, chunked ones
        only those of their own chunk (the same floor(position / attention_chunk_size)),
        which a mask says, whatever the cache (contiguous, paged) holds."""
        full = super().frame(positions, cache, dtype, last)
        chunk = self.args.attention_chunk_size
        if chunk is None or full.length <= chunk:  # all in the first chunk
            return {"full_attention": full, "chunked_attention": full}
        keys = key_positions(positions, full.length, cache)
        mask = attention_mask(positions, keys)
        if mask is None:  # one row's decode step: every key is earlier
            mask = torch.ones(1, 1, 1, keys.shape[1], dtype=torch.bool, device=keys.device)
        same = (positions[:, :, None] // chunk) == (keys[:, None, :] // chunk)
        chunked = dataclasses.replace(full, mask=mask & same[:, None])
        return {"full_attention": full, "chunked_attention": chunked}
