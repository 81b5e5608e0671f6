"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM; llama.cpp's "granitehybrid" GGUFs):
Granite's muP multipliers (granite.py) over a stack of Mamba-2 layers with a few
attention layers among them (`layer_types`), each followed by a feed-forward: top-k
experts plus a shared expert (granitemoe.py's block), or, with no experts, the shared
expert alone as a dense SwiGLU. The released hybrids' attention has no position
encoding (position_embedding_type "nope"); "rope" turns RoPE on. The dense
"granite-4.0-micro" checkpoints are this model type with attention layers only.

The Mamba-2 mixer (Mamba2Mixer, sized by a Mamba2Shape, so that other Mamba-2 hybrids can
build it from their configs) keeps, per sequence, the last d_conv - 1 inputs of its
convolution and an SSD state [heads, head_dim, d_state] in cache.recurrent
(llmrun.models.recurrent): a prompt runs through the state in chunks (ssd_chunked), a
decode step through the one-token recurrence (ssd_step).

Reference: transformers/models/granitemoehybrid/modeling_granitemoehybrid.py (the mixer
as in bamba/ and mamba2/). Parameter names are Hugging Face checkpoint keys, with the
feed-forward under granitemoe.py's names (llmrun/loading/granitehybrid.py renames).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import granite, granitemoe
from llmrun.models.base import CausalLM, Frame, Hybrid, RMSNorm, args_from_config
from llmrun.models.cache import KVCache

# config.json's layer type names (transformers 5's and the Hub's older ones) -> ours.
LAYER_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}
POSITION_EMBEDDINGS = ("rope", "nope")  # None in a config.json means "nope"
SSD_CHUNK = 64  # tokens a prompt's SSD takes at once (the result does not depend on it)


@dataclass
class ModelArgs(granitemoe.ModelArgs):
    num_local_experts: int = 8  # 0: no experts, the shared expert alone
    shared_intermediate_size: int = 1024
    position_embedding_type: str | None = None
    layer_types: list[str] | None = None  # None: every layer Mamba-2, as transformers
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        if self.num_local_experts:
            super().__post_init__()
        else:
            granite.ModelArgs.__post_init__(self)
        kinds = self.layer_types or ["mamba"] * self.num_hidden_layers
        unknown = sorted({k for k in kinds if k not in LAYER_KINDS})
        if unknown:
            raise UnsupportedError(
                f"granitemoehybrid layer types {unknown} are not supported "
                f"(supported: {', '.join(LAYER_KINDS)})"
            )
        if len(kinds) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(kinds)} layers, but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        self.layer_types = [LAYER_KINDS[k] for k in kinds]
        kind = self.position_embedding_type or "nope"
        if kind not in POSITION_EMBEDDINGS:
            raise UnsupportedError(
                f"position_embedding_type {kind!r} is not supported (supported: rope, nope)"
            )
        self.position_embedding_type = kind
        inner = self.mamba_expand * self.hidden_size
        if self.mamba_d_head == "auto":
            self.mamba_d_head = inner // self.mamba_n_heads
        if (
            self.mamba_d_head * self.mamba_n_heads != inner
            or self.mamba_n_heads % self.mamba_n_groups
        ):
            raise ModelFormatError(
                f"Mamba-2 heads do not fit: {self.mamba_n_heads} heads of {self.mamba_d_head} "
                f"in an inner size of {inner} (mamba_expand * hidden_size), "
                f"{self.mamba_n_groups} groups"
            )
        self.time_step_limit = tuple(_float(v) for v in self.time_step_limit)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # Older configs name the layer types layers_block_type (transformers' attribute_map).
        if config.get("layer_types") is None and config.get("layers_block_type") is not None:
            config = {**config, "layer_types": config["layers_block_type"]}
        return args_from_config(cls, config)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "attention"]

    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_n_groups,
            self.mamba_d_state, self.mamba_d_conv, self.mamba_conv_bias, self.mamba_proj_bias,
            self.rms_norm_eps, self.time_step_limit,
        )  # fmt: skip

    def layer_windows(self) -> list[None]:
        """One entry per KV cache layer: the attention layers, all full."""
        return [None] * len(self.attention_layers)

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each Mamba-2 layer's state of one sequence (Mamba2Shape.state_shapes)."""
        shapes = self.mamba_shape().state_shapes()
        return {i: shapes for i, kind in enumerate(self.layer_types) if kind == "mamba"}


def _float(value: Any) -> float:
    """A config.json number, which transformers 5 writes {"__float__": "Infinity"} where it
    is not finite."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelFormatError(f"time_step_limit holds {value!r}, not a number") from None


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 mixer's sizes, which each family's config names in its own way."""

    hidden_size: int
    heads: int
    head_dim: int
    groups: int  # of B and C, each shared by heads / groups heads
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # in_proj's and out_proj's
    eps: float  # the gated norm's
    time_step_limit: tuple[float, float]

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: x, B and C."""
        return self.inner + 2 * self.groups * self.state_size

    def state_shapes(self) -> list[tuple[int, ...]]:
        """One sequence's state: the convolution's last inputs [channels, kernel - 1] and
        the SSD state [heads, head_dim, state_size]."""
        return [
            (self.conv_channels, self.conv_kernel - 1),
            (self.heads, self.head_dim, self.state_size),
        ]


class Attention(granite.Attention):
    """Granite's attention, with RoPE only where position_embedding_type is "rope";
    `layer` is its index among the attention layers (its KV cache layer)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.rope = args.position_embedding_type == "rope"

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return frame.rotate(x) if self.rope else x


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over each of n_groups equal groups of features, in f32."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        grouped = gated.unflatten(-1, (self.groups, -1))  # [..., D] -> [..., G, D / G]
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2: in_proj -> gate z, the convolution's inputs xBC and dt; xBC through a
    causal depthwise convolution and SiLU, split into x (heads of head_dim), B and C
    (n_groups of d_state, each shared by heads / n_groups heads); the SSD recurrence
    per head h, with dt = softplus(dt + dt_bias) and A = -exp(A_log):
        S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,  y_t = S_t C_t + D x_t;
    then the gated, grouped RMSNorm of y and z, and out_proj."""

    def __init__(self, shape: Mamba2Shape, layer: int) -> None:
        """`layer`: the model's layer index, under which cache.recurrent keeps its state."""
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = shape.heads, shape.head_dim
        self.groups, self.state_size = shape.groups, shape.state_size
        self.inner, channels = shape.inner, shape.conv_channels
        self.time_step_limit = shape.time_step_limit
        self.in_proj = nn.Linear(
            shape.hidden_size, self.inner + channels + self.heads, bias=shape.proj_bias
        )
        self.conv1d = nn.Conv1d(
            channels, channels, shape.conv_kernel, groups=channels, bias=shape.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.groups, shape.eps)
        self.out_proj = nn.Linear(self.inner, shape.hidden_size, bias=shape.proj_bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        z, xbc, dt = self.project(x).split([self.inner, self.conv1d.in_channels, self.heads], -1)
        if cache is None:
            conv_state = xbc.new_zeros(batch, xbc.shape[-1], self.conv1d.kernel_size[0] - 1)
            state = xbc.new_zeros(batch, self.heads, self.head_dim, self.state_size).float()
            counts = torch.full((batch,), tokens, device=x.device)
        else:
            if cache.recurrent is None:
                raise RuntimeError(
                    "Mamba-2 layers need a cache with their state (the model's new_cache)"
                )
            conv_state, state = cache.recurrent.read(self.layer)
            counts = frame.counts.to(x.device)
        xbc, conv_state = self.convolve(xbc, conv_state, counts)
        group_width = self.groups * self.state_size
        hs, b, c = xbc.split([self.inner, group_width, group_width], -1)
        # [B, T, heads * head_dim] -> [B, T, heads, head_dim]; B, C: [B, T, groups, d_state]
        hs = hs.unflatten(-1, (self.heads, self.head_dim)).float()
        b = b.unflatten(-1, (self.groups, self.state_size)).float()
        c = c.unflatten(-1, (self.groups, self.state_size)).float()
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        # Right padding: no step (a decay of 1, no input), so the state stays the row's.
        real = torch.arange(tokens, device=x.device)[None] < counts[:, None]
        dt = dt * real[..., None]
        a = -torch.exp(self.A_log.float())
        scan = ssd_step if tokens == 1 else ssd_chunked
        y, state = scan(hs, dt, a, b, c, state.float())
        y = y + self.D.float()[:, None] * hs
        if cache is not None:
            cache.recurrent.write(self.layer, [conv_state.float(), state])
        y = self.norm(y.flatten(-2), z).to(x.dtype)  # the scan's f32 into the norm, as HF
        if cache is not None and bool((counts < tokens).any()):
            # A padded token repeats its row's last real token: so it gets that token's
            # output, and every later layer (the attention's keys and values, written at
            # the same position) sees it as that token, as in an attention-only model.
            last = torch.minimum(torch.arange(tokens, device=x.device)[None], counts[:, None] - 1)
            y = y.gather(1, last[..., None].expand(-1, -1, y.shape[-1]))
        return self.out_proj(y)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """in_proj(x): z, xBC and dt side by side [B, T, inner + channels + heads] (Falcon-H1
        scales its input and each of its parts)."""
        return self.in_proj(x)

    def convolve(
        self, xbc: torch.Tensor, past: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """silu(conv(xbc)) [B, T, channels] over the last inputs `past` [B, channels,
        d_conv - 1] and these, and each row's new last inputs: those up to its last real
        token, so padding never enters them."""
        inputs = xbc.transpose(1, 2)  # [B, T, channels] -> [B, channels, T]
        kept = past.shape[-1]
        window = torch.cat((past.to(inputs.dtype), inputs), dim=-1)  # [B, channels, kept + T]
        starts = counts[:, None] + torch.arange(kept, device=window.device)
        new_past = window.gather(2, starts[:, None, :].expand(-1, window.shape[1], -1))
        out = F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=window.shape[1])
        return F.silu(out).transpose(1, 2), new_past


def _heads_of_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [..., groups, N] as [..., heads, N]: head h reads group h // (heads / groups)."""
    return x.repeat_interleave(heads // x.shape[-2], dim=-2)


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence token by token (f32): x [B, T, H, P], dt [B, T, H] (after
    softplus), a [H] (A, negative), b/c [B, T, G, N], state [B, H, P, N]. Returns y
    [B, T, H, P] (without the D skip) and the state after the last token."""
    heads = x.shape[2]
    b, c = _heads_of_groups(b, heads), _heads_of_groups(c, heads)
    out = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * a)[..., None, None]  # [B, H, 1, 1]
        step = (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]  # [B, H, P, N]
        state = decay * state + step
        out.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]))
    return torch.stack(out, dim=1), state


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int = SSD_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_step's outputs and final state, `chunk` tokens at a time. Within a chunk,
    with s_t the sum of dt_k a over its tokens k <= t, token t receives from an earlier
    token j of the chunk exp(s_t - s_j) (C_t . B_j) dt_j x_j (one masked matrix product)
    and from the state entering the chunk exp(s_t) S C_t; the state leaving it is
    exp(s_last) S + sum_j exp(s_last - s_j) dt_j x_j B_j^T."""
    heads, length = x.shape[2], x.shape[1]
    b, c = _heads_of_groups(b, heads), _heads_of_groups(c, heads)
    outputs = []
    for start in range(0, length, chunk):
        part = slice(start, start + chunk)
        xs, dts, bs, cs = x[:, part], dt[:, part], b[:, part], c[:, part]
        log_decay = (dts * a).transpose(1, 2)  # dt_k a [B, H, L]
        cumulative = log_decay.cumsum(-1)  # s_t
        # decay[t, j] = exp(s_t - s_j) for j <= t, else 0; summed over the run j < k <= t
        # itself rather than as s_t - s_j, whose difference of large sums would cancel.
        steps = log_decay.shape[-1]
        ones = torch.ones(steps, steps, dtype=torch.bool, device=x.device)
        runs = log_decay[..., :, None].expand(*log_decay.shape, steps)  # [B, H, t, j]: a_t
        runs = runs.masked_fill(~ones.tril(-1), 0.0).cumsum(-2)
        decay = runs.exp().masked_fill(~ones.tril(), 0.0)
        inputs = xs * dts[..., None]  # dt_j x_j [B, L, H, P]
        scores = torch.einsum("bthn,bjhn->bhtj", cs, bs) * decay
        y = torch.einsum("bhtj,bjhp->bthp", scores, inputs)
        entering = torch.einsum("bthn,bhpn->bthp", cs, state)
        y = y + entering * cumulative.exp().transpose(1, 2)[..., None]
        to_end = (cumulative[..., -1:] - cumulative).exp().transpose(1, 2)  # [B, L, H]
        added = torch.einsum("bjhn,bjhp->bhpn", bs * to_end[..., None], inputs)
        state = cumulative[..., -1].exp()[..., None, None] * state + added
        outputs.append(y)
    return torch.cat(outputs, dim=1), state


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)) * residual_multiplier (the mixer: Mamba-2 or attention), then
    x + feed_forward(norm(x)) * residual_multiplier."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.residual_multiplier = args.residual_multiplier
        if args.layer_types[layer] == "mamba":
            self.mamba = Mamba2Mixer(args.mamba_shape(), layer)
        else:
            self.self_attn = attention(args, args.attention_layers.index(layer))
        self.mlp = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "mamba"):
            x = x + self.mamba(h, frame, cache) * self.residual_multiplier
        else:
            x = x + self.self_attn(h, frame, cache)  # scaled by granite.Attention
        return x + self.mlp(self.post_attention_layernorm(x))


def feed_forward(args: ModelArgs) -> nn.Module:
    """The experts with the shared expert (granitemoe's block), or without experts the
    shared expert alone: Granite's dense MLP, shared_intermediate_size wide."""
    if args.num_local_experts:
        return granitemoe.SparseMoeBlock(args)
    return granite.MLP(dataclasses.replace(args, intermediate_size=args.shared_intermediate_size))


class Model(Hybrid, granite.Model):
    """Granite's embedding and logit scaling (granite.Model) over the hybrid layers."""

    def __init__(self, args: ModelArgs) -> None:
        CausalLM.__init__(self, args, Attention, feed_forward, DecoderLayer)
