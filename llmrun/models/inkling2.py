"""Inkling 2 (Thinking Machines' Inkling-2-Small): the text model of Inkling2ForCausalLM
and of Inkling2ForConditionalGeneration.

No RoPE: positions reach attention through per-token relative position biases and short
causal convolutions. Each layer is "hybrid_sliding" (windowed attention) or "hybrid" (full
attention, with its own head counts). Queries are scaled and clipped to an L2 norm (full
layers also scale them up logarithmically past log_scaling_n_floor); keys and values go
through a short convolution after their projection (static taps in sliding layers, taps
plus per-token taps projected from the layer input in full ones), then keys are clipped
and values RMS-normalized. Each head has a per-token attention sink and a bias per
backward distance (the token's relative states mixing a learned bank of profiles); the
output is gated by a sigmoid of the layer input. The attention and the MoE feed-forward
(sigmoid router with selection bias, soft-capped SwiGLU experts) are each followed by a
short convolution. Block attention residuals replace the plain residual stream: every
n_layers_per_attn_res_block layers the stream is kept as a block, and each sublayer's
input is an attention, with learned queries, over the kept blocks and the current stream
(full layers take three: for their queries, keys and values).

Each layer keeps keys and values (a sliding layer's full length, masked to its window)
and four convolution states per sequence (llmrun.models.recurrent): keys', values', and
the two output convolutions' last conv_kernel_size - 1 inputs.

Reference: transformers/models/inkling2/modeling_inkling2.py. Parameter names are
transformers' (the loader renames the Hub's, llmrun.loading.inkling2).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import Frame, attention_mask, key_positions
from llmrun.models.cache import KVCache
from llmrun.models.recurrent import RecurrentState

SLIDING, FULL = "hybrid_sliding", "hybrid"
# Inkling2PreTrainedModel._keep_in_fp32_modules_strict: parts of the names of the weights
# transformers keeps in f32.
FLOAT32_PARTS = (
    "e_score_correction_bias",
    "mlp.gate.weight",
    "post_attention_convolution",
    "post_mlp_convolution",
    "sconv.conv1d",
    "attention_input",
    "mlp_input",
    "final_input",
)
# Inkling2TextConfig's attribute_map: other names config.json may use.
ALIASES = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "intermediate_size": "moe_intermediate_size",
    "routed_scaling_factor": "route_scale",
}


@dataclass
class ModelArgs:
    hidden_size: int = 4608
    num_hidden_layers: int = 48
    vocab_size: int = 201024
    unpadded_vocab_size: int = 200058
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 48
    swa_num_key_value_heads: int = 8
    swa_head_dim: int = 128
    sliding_window_size: int = 1024
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int = 128000
    log_scaling_alpha: float = 0.1
    layer_types: list[str] | None = None
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    hidden_act: str = "silu"
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    route_scale: float = 8.0
    qk_l2_clip_threshold: float = 22.627416997969522
    rel_l2_clip_threshold: float = 8.0
    n_layers_per_attn_res_block: int = 6
    mlp_gate_softcap: float = 4.0
    mlp_up_softcap: float = 25.0
    final_logit_softcapping: float = 30.0
    scoring_func: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [
                FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {self.num_hidden_layers}"
            )
        for kind in self.layer_types:
            if kind not in (SLIDING, FULL):
                raise UnsupportedError(f"Inkling 2 layer type {kind!r} is not supported")
        if self.scoring_func != "sigmoid":
            raise UnsupportedError(f"Inkling 2 router scoring {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise UnsupportedError(f"Inkling 2 expert activation {self.hidden_act!r}")
        if not 0 < self.unpadded_vocab_size <= self.vocab_size:
            raise ModelFormatError(
                f"unpadded_vocab_size {self.unpadded_vocab_size} is not within vocab_size "
                f"{self.vocab_size}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = {ALIASES.get(k, k): v for k, v in config.items()}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    def heads(self, layer: int) -> tuple[int, int, int]:
        """The layer's (query heads, key/value heads, head_dim)."""
        if self.layer_types[layer] == SLIDING:
            return self.swa_num_attention_heads, self.swa_num_key_value_heads, self.swa_head_dim
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    def cache_shapes(self) -> list[tuple[int, int]]:
        """Each layer's cached (KV heads, head_dim)."""
        return [self.heads(i)[1:] for i in range(self.num_hidden_layers)]

    def layer_windows(self) -> list[None]:
        """Sliding layers keep every position (masked to the window): their keys' relative
        biases are read by position (llmrun.models.kv_cache_bytes)."""
        return [None] * self.num_hidden_layers

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each layer's convolution states of one sequence: the last conv_kernel_size - 1
        inputs of its key, value, post-attention and post-MLP convolutions."""
        kept = self.conv_kernel_size - 1
        shapes = {}
        for i in range(self.num_hidden_layers):
            _, kv_heads, head_dim = self.heads(i)
            kv = (kv_heads * head_dim, kept)
            shapes[i] = [kv, kv, (self.hidden_size, kept), (self.hidden_size, kept)]
        return shapes


@dataclass
class InklingFrame(Frame):
    """A Frame with the relative distances [B, T, L] of each query to the keys attended."""

    distance: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """Normalized and weighted in f32, returned in the input's dtype (transformers'
    Inkling2RMSNorm: the block attention residuals hand their norms f32 inputs)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x.float(), self.weight.float(), self.eps).to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """x scaled down to an L2 norm of `threshold` (last dim) where it is longer, in f32."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + 1e-6)).clamp(max=1.0)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class ScaledL2Clip(nn.Module):
    """x * scale (per head and feature), clipped to an L2 norm per head; with log_scaling
    then times 1 + alpha * log(max((position + 1) / n_floor, 1))."""

    def __init__(self, args: ModelArgs, heads: int, width: int, threshold: float, log: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(heads, width))
        self.threshold = threshold
        self.log = (args.log_scaling_alpha, args.log_scaling_n_floor) if log else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = l2_clip(x.float() * self.scale.float(), self.threshold)
        if self.log is not None:
            x = x.to(dtype).float()  # rounded between the two, as transformers rounds
            alpha, floor = self.log
            tau = 1.0 + alpha * torch.log(((positions + 1).float() / floor).clamp(min=1.0))
            x = x * tau[..., None, None]
        return x.to(dtype)


class Projection(nn.Module):
    """The queries' projection, under transformers' name (q_proj.linear, q_proj.norm)."""

    def __init__(self, args: ModelArgs, heads: int, width: int, log: bool) -> None:
        super().__init__()
        self.width = width
        self.linear = nn.Linear(args.hidden_size, heads * width, bias=False)
        self.norm = ScaledL2Clip(args, heads, width, args.qk_l2_clip_threshold, log)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        states = self.linear(x)
        return self.norm(states.unflatten(-1, (-1, self.width)), positions)


def convolution_window(
    x: torch.Tensor, kept: int, part: int, layer: int, frame: Frame, cache: KVCache | None
) -> torch.Tensor:
    """x [B, T, C] after the `kept` inputs before it ([B, C, kept + T]): the sequence's
    state (zeros at position 0, or without a cache), which then becomes the last `kept`
    inputs up to each row's last real token (padding never enters it)."""
    inputs = x.float().transpose(1, 2)
    if cache is None:
        return F.pad(inputs, (kept, 0))
    if cache.recurrent is None:
        raise RuntimeError("Inkling 2's convolutions need a cache with their state (new_cache)")
    state = cache.recurrent.read(layer)
    window = torch.cat((state[part].to(inputs.dtype), inputs), dim=-1)
    starts = frame.counts.to(window.device)[:, None] + torch.arange(kept, device=window.device)
    state[part] = window.gather(2, starts[:, None, :].expand(-1, window.shape[1], -1))
    cache.recurrent.write(layer, state)
    return window


class ShortConvolution(nn.Module):
    """(conv(x) + x) / sqrt(taps + 1), the causal depthwise convolution over the
    sequence's earlier inputs, in f32."""

    def __init__(self, channels: int, taps: int, layer: int, part: int) -> None:
        super().__init__()
        self.layer, self.part = layer, part
        self.conv1d = nn.Conv1d(channels, channels, taps, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        taps = self.conv1d.kernel_size[0]
        window = convolution_window(x, taps - 1, self.part, self.layer, frame, cache)
        out = F.conv1d(window, self.conv1d.weight.float(), groups=window.shape[1])
        return ((out.transpose(1, 2) + x.float()) / math.sqrt(taps + 1)).to(x.dtype)


class DynamicShortConvolution(nn.Module):
    """A short convolution whose taps are static_weight plus per-token taps projected
    from the layer input (one set per key/value head): (conv(x) + x) / sqrt(2 taps + 1)."""

    def __init__(self, args: ModelArgs, heads: int, width: int, layer: int, part: int) -> None:
        super().__init__()
        self.layer, self.part, self.heads = layer, part, heads
        self.taps = args.conv_kernel_size
        # static_weight[lag]: the taps of the token `lag` steps back
        self.static_weight = nn.Parameter(torch.zeros(self.taps, heads * width))
        self.weight_proj = nn.Linear(args.hidden_size, heads * self.taps, bias=False)

    def forward(
        self, x: torch.Tensor, layer_input: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        batch, tokens, channels = x.shape
        dynamic = self.weight_proj(layer_input).float().view(batch, tokens, self.heads, 1, -1)
        taps = self.static_weight.float().T.reshape(self.heads, -1, self.taps) + dynamic
        window = convolution_window(x, self.taps - 1, self.part, self.layer, frame, cache)
        # [B, C, taps - 1 + T] -> [B, T, heads, C / heads, taps], lag 0 the token itself
        lags = window.unfold(-1, self.taps, 1).flip(-1).transpose(1, 2)
        lags = lags.reshape(batch, tokens, self.heads, -1, self.taps)
        out = (lags * taps).sum(-1).reshape(batch, tokens, channels)
        return ((out + x.float()) / math.sqrt(2 * self.taps + 1)).to(x.dtype)


class KeyValueProjection(nn.Module):
    """A key (`part` 0, its convolution state's index) or value (`part` 1) projection:
    linear, short convolution, then an L2 clip (keys) or an RMS norm without weights
    (values), per head."""

    def __init__(
        self, args: ModelArgs, heads: int, width: int, layer: int, part: int, dynamic: bool
    ) -> None:
        super().__init__()
        self.width, self.is_key, self.args = width, part == 0, args
        self.linear = nn.Linear(args.hidden_size, heads * width, bias=False)
        if dynamic:
            self.sconv = DynamicShortConvolution(args, heads, width, layer, part)
        else:
            self.sconv = ShortConvolution(heads * width, args.conv_kernel_size, layer, part)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        states = self.linear(x)
        if isinstance(self.sconv, DynamicShortConvolution):
            states = self.sconv(states, x, frame, cache)
        else:
            states = self.sconv(states, frame, cache)
        heads = states.unflatten(-1, (-1, self.width)).float()
        if self.is_key:
            heads = l2_clip(heads, self.args.qk_l2_clip_threshold)
        else:
            heads = unweighted_rms_norm(heads, self.args.rms_norm_eps)
        return heads.to(x.dtype).transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]


class RelativePositionBias(nn.Module):
    """Per head, query and key, (relative states of the query @ proj)[distance] for
    backward distances 0 .. extent - 1, else 0."""

    def __init__(self, args: ModelArgs, heads: int, extent: int, log: bool) -> None:
        super().__init__()
        self.heads, self.extent = heads, extent
        self.linear = nn.Linear(args.hidden_size, heads * args.d_rel, bias=False)
        self.norm = ScaledL2Clip(args, heads, args.d_rel, args.rel_l2_clip_threshold, log)
        self.proj = nn.Parameter(torch.empty(args.d_rel, extent))

    def forward(self, x: torch.Tensor, frame: InklingFrame) -> torch.Tensor:
        states = self.norm(self.linear(x).unflatten(-1, (self.heads, -1)), frame.positions)
        # [B, T, H, d_rel] @ [d_rel, extent] -> [B, H, T, extent]
        profiles = (states @ self.proj).transpose(1, 2)
        distance = frame.distance[:, None].expand(-1, self.heads, -1, -1)
        bias = profiles.gather(-1, distance.clamp(0, self.extent - 1))
        return bias.masked_fill((distance < 0) | (distance >= self.extent), 0.0)


class GatedOutput(nn.Module):
    """linear(attention output * sigmoid(gate_proj(layer input)))."""

    def __init__(self, args: ModelArgs, features: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, features, bias=False)
        self.linear = nn.Linear(features, args.hidden_size, bias=False)

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_proj(x).float())
        return self.linear((out.float() * gate).to(out.dtype))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.sliding = args.layer_types[layer] == SLIDING
        heads, kv_heads, width = args.heads(layer)
        self.scale = width**-0.5
        full = not self.sliding
        self.q_proj = Projection(args, heads, width, log=full)
        self.k_proj = KeyValueProjection(args, kv_heads, width, layer, 0, dynamic=full)
        self.v_proj = KeyValueProjection(args, kv_heads, width, layer, 1, dynamic=full)
        self.o_proj = GatedOutput(args, heads * width)
        self.sink_proj = nn.Linear(args.hidden_size, heads, bias=False)
        extent = args.sliding_window_size if self.sliding else args.rel_extent
        self.relative_position_bias = RelativePositionBias(args, heads, extent, log=full)

    def forward(
        self,
        x: torch.Tensor,
        keys_input: torch.Tensor,
        values_input: torch.Tensor,
        frame: InklingFrame,
        cache: KVCache | None,
    ) -> torch.Tensor:
        q = self.q_proj(x, frame.positions).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(keys_input, frame, cache)
        v = self.v_proj(values_input, frame, cache)
        if cache is not None and cache.paged:
            cache.write(self.layer, k, v, frame.positions)
            k, v = cache.read(self.layer, frame.length, q.dtype)
        elif cache is not None:
            k, v = cache.update(self.layer, k, v, frame.positions, frame.start, frame.length, False)
        bias = self.relative_position_bias(x, frame)
        sinks = self.sink_proj(x).transpose(1, 2)[..., None]  # [B, H, T, 1]
        out = sink_attention(q, k, v, frame.mask, self.scale, bias, sinks)
        return self.o_proj(out, x)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """softmax over [q k^T * scale + bias (+ mask), sink], the sink's share dropped, times
    v: q [B, H, T, D], k/v [B, Hkv, L, D], bias [B, H, T, L], sinks [B, H, T, 1], mask
    [B, 1, T, L] (True: attend) or None; returns [B, T, H*D]. The scores in q's dtype,
    the softmax in f32, as transformers' eager attention computes them."""
    batch, heads, tokens, width = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale + bias.to(q.dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(torch.cat((scores.float(), sinks.float()), dim=-1), dim=-1)[..., :-1]
    out = weights.to(v.dtype) @ v
    return out.transpose(1, 2).reshape(batch, tokens, heads * width)


class BlockAttentionResidual(nn.Module):
    """`queries` learned queries attending over the RMS-normalized kept blocks and the
    current stream (the values being those normalized states): one input per query."""

    def __init__(self, args: ModelArgs, queries: int = 1) -> None:
        super().__init__()
        shape = (args.hidden_size,) if queries == 1 else (queries, args.hidden_size)
        self.query = nn.Parameter(torch.zeros(shape))

    def forward(self, blocks: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # [B, T, blocks + 1, hidden], each state normalized
        states = unweighted_rms_norm(torch.stack([*blocks, x], dim=-2), 1e-6)
        query = self.query.float().view(-1, states.shape[-1])  # [Q, hidden]
        weights = torch.softmax((query @ states.transpose(-1, -2)) * states.shape[-1] ** -0.5, -1)
        return (weights @ states).unbind(-2)  # Q of [B, T, hidden]


class Experts(nn.Module):
    """The routed experts, stacked as transformers keeps them: gate_up_proj [E, 2I, H],
    down_proj [E, H, I]; each softcap(g, a) * sigmoid(g) * softcap(u, b), summed in f32."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        experts, hidden, width = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))
        self.caps = args.mlp_gate_softcap, args.mlp_up_softcap

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in chosen.unique().tolist():
            rows, slot = torch.where(chosen == expert)
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).float().chunk(2, dim=-1)
            act = softcap(gate, self.caps[0]) * torch.sigmoid(gate) * softcap(up, self.caps[1])
            y = F.linear(act.to(x.dtype), self.down_proj[expert]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.float())
        return out.to(x.dtype)


class Router(nn.Module):
    """Sigmoid scores; the top k by score + selection bias, weighted by their scores
    normalized to sum 1, times route_scale (all in f32)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.route_scale = args.num_experts_per_tok, args.route_scale
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        biased = scores + self.e_score_correction_bias.float()
        chosen = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.route_scale


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.experts = Experts(args)
        self.gate = Router(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.gate(flat)
        return self.experts(flat, chosen, weights).view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.sliding = args.layer_types[layer] == SLIDING
        self.is_block_boundary = layer % args.n_layers_per_attn_res_block == 0
        if layer > 0:
            self.attention_input = BlockAttentionResidual(args, 1 if self.sliding else 3)
        self.mlp_input = BlockAttentionResidual(args)
        self.self_attn = Attention(args, layer)
        self.mlp = SparseMoeBlock(args)
        hidden, eps, taps = args.hidden_size, args.rms_norm_eps, args.conv_kernel_size
        if self.sliding:
            self.input_layernorm = RMSNorm(hidden, eps)
        else:
            self.q_input_layernorm = RMSNorm(hidden, eps)
            self.k_input_layernorm = RMSNorm(hidden, eps)
            self.v_input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_attention_convolution = ShortConvolution(hidden, taps, layer, 2)
        self.post_mlp_convolution = ShortConvolution(hidden, taps, layer, 3)

    def forward(
        self,
        x: torch.Tensor,
        blocks: list[torch.Tensor],
        frame: InklingFrame,
        cache: KVCache | None,
    ) -> torch.Tensor:
        dtype = x.dtype
        inputs = (x,) * 3
        if hasattr(self, "attention_input"):
            inputs = self.attention_input(blocks, x)
        if self.sliding:
            q = k = v = self.input_layernorm(inputs[0]).to(dtype)
        else:
            q = self.q_input_layernorm(inputs[0]).to(dtype)
            k = self.k_input_layernorm(inputs[1]).to(dtype)
            v = self.v_input_layernorm(inputs[2]).to(dtype)
        out = self.post_attention_convolution(self.self_attn(q, k, v, frame, cache), frame, cache)
        residual = out.float()
        if self.is_block_boundary:
            blocks = [*blocks, x]
        else:
            residual = x.float() + residual
        (h,) = self.mlp_input(blocks, residual)
        h = self.mlp(self.post_attention_layernorm(h).to(dtype))
        return (residual + self.post_mlp_convolution(h, frame, cache).float()).to(dtype)


class NormedEmbedding(nn.Embedding):
    """The token embedding, then an RMSNorm (embed_norm)."""

    def __init__(self, vocab: int, hidden: int, eps: float) -> None:
        super().__init__(vocab, hidden)
        self.embed_norm = RMSNorm(hidden, eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(input_ids))


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = NormedEmbedding(args.vocab_size, args.hidden_size, args.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.final_input = BlockAttentionResidual(args)


class Model(nn.Module):
    """embed -> layers (with the kept blocks) -> final block attention -> norm -> lm_head
    (unpadded_vocab_size rows) -> soft-capped logits, with transformers' module names."""

    decode_step = None  # no native decode step: see llmrun.quant.decode_step.FAMILIES

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.unpadded_vocab_size, bias=False)

    @property
    def float32_weights(self) -> tuple[str, ...]:
        """The weights kept in f32 whatever the compute dtype, as transformers keeps them
        (_keep_in_fp32_modules_strict): routers, convolution taps and block queries."""
        return tuple(n for n in self.state_dict() if any(part in n for part in FLOAT32_PARTS))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, unpadded vocab] (or [B, 1, ...]: last_only, or `last` [B],
        each row's last real token) of input_ids [B, T] at positions [B, T]."""
        if static is not None:
            raise UnsupportedError("Inkling 2 has no static decode step (CUDA graphs)")
        x = self.model.embed_tokens(input_ids)
        dtype = x.dtype
        frames = self.frames(positions, cache, dtype)
        blocks: list[torch.Tensor] = []
        for layer in self.model.layers:
            out = layer(x, blocks, frames[layer.sliding], cache)
            if layer.is_block_boundary:
                blocks.append(x)
            x = out
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
            blocks = [b[torch.arange(b.shape[0], device=b.device), last][:, None] for b in blocks]
        elif last_only:
            x, blocks = x[:, -1:], [b[:, -1:] for b in blocks]
        (x,) = self.model.final_input(blocks, x)
        logits = self.lm_head(self.model.norm(x).to(dtype)).float()
        return softcap(logits, self.args.final_logit_softcapping)

    def frames(
        self, positions: torch.Tensor, cache: KVCache | None, dtype: torch.dtype
    ) -> dict[bool, InklingFrame]:
        """The full layers' frame (False) and the sliding layers' (True): masks, and the
        distance of each query to each key attended, by position."""
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        keys = key_positions(positions, length, cache)
        distance = positions[:, :, None] - keys[:, None, :]
        counts = None
        if cache is not None and cache.recurrent is not None:
            counts = cache.recurrent.begin(positions)
        none = positions.new_zeros(0, dtype=dtype)
        frames = {}
        for sliding in (False, True):
            window = self.args.sliding_window_size if sliding else None
            mask = attention_mask(positions, keys, window)
            frames[sliding] = InklingFrame(
                positions, start, length, mask, none, none, counts=counts, distance=distance
            )
        return frames

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        args = self.args
        cache = KVCache(
            args.num_hidden_layers, batch, args.num_key_value_heads, max_seq_len,
            args.head_dim, dtype, device, shapes=args.cache_shapes(),
        )  # fmt: skip
        cache.recurrent = RecurrentState(args.recurrent_shapes(), batch, torch.float32, device)
        return cache
