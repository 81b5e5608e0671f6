"""Mamba (state-spaces/mamba-*-hf) and Falcon Mamba (tiiuae/falcon-mamba-7b): a stack of
Mamba-1 blocks, x + mixer(norm(x)), with no attention. The mixer projects x into an
input and a gate (in_proj); the input goes through a causal depthwise convolution of
conv_kernel taps and SiLU, then a selective scan: x_proj gives each token a time step
(dt_proj, softplus), B and C; a state h [intermediate, state_size] per sequence decays
by exp(dt * A) and takes in dt * B * u; the output is C . h + D * u, gated by silu(gate),
through out_proj. Falcon Mamba normalizes the time step, B and C (RMS norms without
weights, eps mixer_rms_eps) before use.

Each sequence carries the convolution's last conv_kernel - 1 inputs and h from one
forward to the next (llmrun.models.recurrent): the cache holds no keys or values.

Reference: transformers/models/mamba/modeling_mamba.py and
falcon_mamba/modeling_falcon_mamba.py. Parameter names are their checkpoint keys
(backbone.*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    RMSNorm,
    StateOnly,
    StateOnlyArgs,
    args_from_config,
)
from llmrun.models.cache import KVCache

FALCON_MAMBA = "falcon_mamba"
# Tokens whose scan runs at once: the scan's temporaries are [B, SCAN_CHUNK, inner, state].
SCAN_CHUNK = 64


@dataclass
class ModelArgs(StateOnlyArgs):
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    state_size: int = 16
    expand: int = 2
    intermediate_size: int | None = None
    conv_kernel: int = 4
    time_step_rank: int | str = "auto"
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    # Falcon Mamba's norms of the time step, B and C; None: Mamba's, without them.
    mixer_rms_eps: float | None = None
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no attention

    def __post_init__(self) -> None:
        self.intermediate_size = self.intermediate_size or int(self.expand * self.hidden_size)
        if self.time_step_rank == "auto":
            self.time_step_rank = math.ceil(self.hidden_size / 16)
        if self.hidden_act != "silu":
            raise UnsupportedError(
                f"Mamba with hidden_act {self.hidden_act!r} is not supported (its checkpoints "
                "use silu, the only activation llama.cpp runs it with)"
            )
        if self.conv_kernel < 2:
            raise ModelFormatError(f"conv_kernel is {self.conv_kernel}; Mamba needs 2 or more")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        args = args_from_config(cls, config)
        if config.get("model_type") == FALCON_MAMBA:
            args.mixer_rms_eps = config.get("mixer_rms_eps", 1e-6)
        else:
            args.mixer_rms_eps = None
        return args

    def mixer_shape(self) -> MixerShape:
        return MixerShape(
            self.hidden_size, self.intermediate_size, self.state_size, self.conv_kernel,
            self.time_step_rank, self.use_bias, self.use_conv_bias,
        )  # fmt: skip

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each layer's state of one sequence: the convolution's last conv_kernel - 1
        inputs [inner, conv_kernel - 1] and the scan's h [inner, state_size]."""
        inner = self.intermediate_size
        return {
            i: [(inner, self.conv_kernel - 1), (inner, self.state_size)]
            for i in range(self.num_hidden_layers)
        }


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, in float32 (Falcon Mamba's norms of dt, B and C)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def selective_scan(
    decay: torch.Tensor, inputs: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = decay_t * h_{t-1} + inputs_t for every t, from h_0 = `state`: decay and
    inputs [B, T, inner, N], state [B, inner, N] -> (every h_t [B, T, inner, N], the last).
    A parallel prefix scan over time (log2(T) steps, each pairing a token with the one
    `offset` before it): stable, since it only multiplies decays in (0, 1]."""
    decay, inputs = decay.clone(), inputs.clone()
    offset = 1
    while offset < decay.shape[1]:
        inputs[:, offset:] = inputs[:, offset:] + decay[:, offset:] * inputs[:, :-offset]
        decay[:, offset:] = decay[:, offset:] * decay[:, :-offset]
        offset *= 2
    states = inputs + decay * state[:, None]
    return states, states[:, -1]


@dataclass
class MixerShape:
    """A Mamba-1 mixer's sizes (Mamba's and Jamba's configs name them otherwise)."""

    hidden: int
    inner: int
    state: int
    conv_kernel: int
    time_step_rank: int
    bias: bool  # in_proj's and out_proj's
    conv_bias: bool


class MambaMixer(nn.Module):
    """The Mamba-1 mixer of one layer, its state in cache.recurrent (row per sequence).
    `rms_eps`: Falcon Mamba's weightless norms of dt, B and C (None: none)."""

    def __init__(self, shape: MixerShape, layer: int, rms_eps: float | None = None) -> None:
        super().__init__()
        self.layer = layer
        inner, n = shape.inner, shape.state
        self.rank, self.n = shape.time_step_rank, n
        self.rms_eps = rms_eps
        self.in_proj = nn.Linear(shape.hidden, 2 * inner, bias=shape.bias)
        self.conv1d = nn.Conv1d(inner, inner, shape.conv_kernel, groups=inner, bias=shape.conv_bias)
        self.x_proj = nn.Linear(inner, self.rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(self.rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, n))
        self.D = nn.Parameter(torch.empty(inner))
        self.out_proj = nn.Linear(inner, shape.hidden, bias=shape.bias)

    def normalize(
        self, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The time step, B and C as the scan takes them (Jamba's norms have weights)."""
        if self.rms_eps is None:
            return dt, b, c
        return tuple(weightless_rms_norm(t, self.rms_eps) for t in (dt, b, c))

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        inputs = u.transpose(1, 2)  # [B, T, inner] -> [B, inner, T]
        kept = self.conv1d.kernel_size[0] - 1
        if cache is None:
            past = inputs.new_zeros(*inputs.shape[:2], kept)
            h = inputs.new_zeros(batch, inputs.shape[1], self.n, dtype=torch.float32)
        else:
            past, h = cache.recurrent.read(self.layer)
        window = torch.cat((past.to(inputs.dtype), inputs), dim=-1)  # [B, inner, kept + T]
        u = F.silu(F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=window.shape[1]))
        u = u.transpose(1, 2)  # [B, T, inner]

        dt, b, c = self.x_proj(u).split([self.rank, self.n, self.n], dim=-1)
        dt, b, c = self.normalize(dt, b, c)
        dt = F.softplus(self.dt_proj(dt).float())  # [B, T, inner]
        if cache is not None:
            # A row's padding (beyond its real tokens) leaves its state as it is: dt = 0
            # decays nothing and takes nothing in.
            real = torch.arange(tokens, device=x.device)[None] < frame.counts.to(x.device)[:, None]
            dt = dt * real[..., None]
        a = -torch.exp(self.A_log.float())  # [inner, N]
        u32, b32, c32 = u.float(), b.float(), c.float()
        outputs = []
        for start in range(0, tokens, SCAN_CHUNK):
            part = slice(start, start + SCAN_CHUNK)
            step = dt[:, part, :, None]  # [B, t, inner, 1]
            decay = torch.exp(step * a)
            taken = step * u32[:, part, :, None] * b32[:, part, None, :]
            states, h = selective_scan(decay, taken, h)
            outputs.append(torch.einsum("btin,btn->bti", states, c32[:, part]))
        y = torch.cat(outputs, dim=1) + u32 * self.D.float()
        y = (y * F.silu(gate.float())).to(x.dtype)

        if cache is not None:
            # Each row's convolution state: the last `kept` inputs up to its last real token.
            starts = frame.counts.to(window.device)[:, None] + torch.arange(
                kept, device=window.device
            )
            conv_state = window.gather(2, starts[:, None, :].expand(-1, window.shape[1], -1))
            cache.recurrent.write(self.layer, [conv_state.float(), h])
        return self.out_proj(y)


class MambaBlock(nn.Module):
    """x + mixer(norm(x))."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.layer_norm_epsilon)
        self.mixer = MambaMixer(args.mixer_shape(), layer, args.mixer_rms_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        return x + self.mixer(self.norm(x), frame, cache)


class Backbone(nn.Module):
    """The embedding, the blocks and the final norm under their Hugging Face names
    (embeddings, layers, norm_f)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm_f = RMSNorm(args.hidden_size, args.layer_norm_epsilon)

    @property
    def embed_tokens(self) -> nn.Module:
        """The embedding, under the name CausalLM and the loader read."""
        return self.embeddings

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.norm_f


class Model(StateOnly, CausalLM):
    """backbone -> lm_head; the KV cache holds no layers, only each block's state."""

    backbone_type: type[nn.Module] = Backbone  # xLSTM's (llmrun/models/xlstm.py) is its own

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.backbone = self.backbone_type(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def model(self) -> nn.Module:
        """The backbone, under the name CausalLM's helpers and the loader read."""
        return self.backbone
