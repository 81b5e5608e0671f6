"""Preferred Networks' PLaMo 2 (plamo-2-1b, -2b, -8b, plamo-2-translate, PLaMo 2.1): a stack
of layers, each x + post_mixer_norm(mixer(pre_mixer_norm(x))), then x +
post_mlp_norm(mlp(pre_mlp_norm(x))); the mixer is Mamba, or, every mamba_step-th layer
(from mamba_step / 2 on), attention. Every norm is an RMSNorm of x * (w + offset), the
offsets 1, 1/5, 1 and 1/5^1.5 in that order, and 1 for the final one.

The attention projects q, k and v at once (qkv_proj), normalizes each head of q and k by
its own weights (q_weight, k_weight: RMSNorm without offset), rotates them NEOX-style
and attends with GQA. The feed-forward is SwiGLU from one gate_up_proj.

The Mamba mixer is Mamba-2's recurrence with Mamba-1's projections: in_proj gives each
head its gate z and input x side by side; x through a causal depthwise convolution
(no bias) and SiLU; bcdt_proj of it gives B and C (one group, d_state each) and a
time-step input of max(64, hidden / 16) features, each RMS-normalized by its own weights
(B_norm_weight, C_norm_weight, dt_norm_weight), the time step then dt_proj'd to one per
head, plus dt_bias, through softplus; the SSD recurrence of Granite 4.0-H's mixer
(granitemoehybrid.ssd_step / ssd_chunked, A = -exp(A_log) a head) plus D x, gated by
silu(z), and out_proj. Its state (the convolution's last inputs, the SSD state) lives in
cache.recurrent, as the other hybrids keep theirs.

Reference: llama.cpp's src/models/plamo2.cpp (llama.cpp is the reference these are tested
against: the Hub's modeling_plamo.py is remote code). Parameter names are the Hub's keys,
but for its layers' "model.layers.layers.N." here "model.layers.N."
(llmrun/loading/plamo2.py renames).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError
from llmrun.models.base import CausalLM, Frame, Hybrid, RotaryEmbedding, args_from_config, attend
from llmrun.models.cache import KVCache
from llmrun.models.granitemoehybrid import Mamba2Mixer, ssd_chunked, ssd_step

# The norms' offsets (the Hub's RMSNorm(offset=...); llama.cpp's converter adds them).
PRE_MIXER, POST_MIXER, PRE_MLP, POST_MLP, FINAL = 1.0, 1.0 / 5, 1.0, 1.0 / 5**1.5, 1.0


def is_mamba(layer: int, layers: int, mamba_step: int) -> bool:
    """Whether `layer` is a Mamba layer (the Hub's is_mamba, as llama.cpp's converter
    reads it): all but the last where the model has mamba_step / 2 layers or fewer, else
    all but those at mamba_step / 2 modulo mamba_step."""
    if layers <= mamba_step // 2:
        return layer != layers - 1
    return layer % mamba_step != mamba_step // 2


@dataclass
class ModelArgs:
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    hidden_size_per_head: int = 128
    intermediate_size: int = 13312
    vocab_size: int = 100000
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    mamba_d_state: int = 64
    mamba_d_conv: int = 4
    mamba_num_heads: int = 64
    mamba_step: int = 2
    mamba_enabled: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # Which layers are Mamba (None: by mamba_step); a GGUF says, by its KV head counts.
    layers_block_type: list[str] | None = None

    def __post_init__(self) -> None:
        if self.layers_block_type is None:
            self.layers_block_type = [
                "mamba"
                if self.mamba_enabled and is_mamba(i, self.num_hidden_layers, self.mamba_step)
                else "attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layers_block_type) != self.num_hidden_layers:
            raise ModelFormatError(
                f"PLaMo 2 layers_block_type lists {len(self.layers_block_type)} layers, but "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"PLaMo 2's {self.num_attention_heads} attention heads do not share "
                f"{self.num_key_value_heads} key/value heads"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def head_dim(self) -> int:
        return self.hidden_size_per_head

    @property
    def time_step_dim(self) -> int:
        """The time step's width before dt_proj (llama.cpp's dt_dim)."""
        return max(64, self.hidden_size // 16)

    @property
    def attention_layers(self) -> list[int]:
        """The attention layers' indices; the KV cache holds these alone, in order."""
        return [i for i, kind in enumerate(self.layers_block_type) if kind == "attention"]

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each Mamba layer's state of one sequence: the convolution's last inputs [inner,
        d_conv - 1] and the SSD state [heads, head_dim, d_state]."""
        inner = self.mamba_num_heads * self.hidden_size_per_head
        shapes = [
            (inner, self.mamba_d_conv - 1),
            (self.mamba_num_heads, self.hidden_size_per_head, self.mamba_d_state),
        ]
        return {i: shapes for i, kind in enumerate(self.layers_block_type) if kind == "mamba"}

    def layer_windows(self) -> list[None]:
        """One entry per KV cache layer: the attention layers, all full."""
        return [None] * len(self.attention_layers)


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (weight + offset)."""

    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, offset=self.offset)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, times `weight` (broadcast over what precedes)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


class Attention(nn.Module):
    """`layer`: its index among the attention layers (its KV cache layer)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.eps = layer, args.rms_norm_eps
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.q_weight = nn.Parameter(torch.ones(self.n_heads, self.head_dim))
        self.k_weight = nn.Parameter(torch.ones(self.n_kv_heads, self.head_dim))
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, kv, kv], -1)
        # [B, T, H*D] -> [B, H, T, D], q and k normalized per head
        q = _rms(q.view(batch, tokens, self.n_heads, -1), self.q_weight, self.eps).transpose(1, 2)
        k = _rms(k.view(batch, tokens, self.n_kv_heads, -1), self.k_weight, self.eps)
        k = k.transpose(1, 2)
        v = v.view(batch, tokens, self.n_kv_heads, -1).transpose(1, 2)
        out = attend(frame.rotate(q), frame.rotate(k), v, self.layer, frame, cache)
        return self.o_proj(out)


class Mamba(nn.Module):
    """`layer`: the model's layer index, under which cache.recurrent keeps its state."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.eps = layer, args.rms_norm_eps
        self.heads, self.head_dim = args.mamba_num_heads, args.hidden_size_per_head
        self.state_size, self.time_step_dim = args.mamba_d_state, args.time_step_dim
        inner = self.heads * self.head_dim
        self.in_proj = nn.Linear(args.hidden_size, 2 * inner, bias=False)
        self.conv1d = nn.Conv1d(inner, inner, args.mamba_d_conv, groups=inner, bias=False)
        self.bcdt_proj = nn.Linear(inner, 2 * self.state_size + self.time_step_dim, bias=False)
        self.dt_proj = nn.Linear(self.time_step_dim, self.heads, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.heads))
        self.dt_norm_weight = nn.Parameter(torch.ones(self.time_step_dim))
        self.B_norm_weight = nn.Parameter(torch.ones(self.state_size))
        self.C_norm_weight = nn.Parameter(torch.ones(self.state_size))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.out_proj = nn.Linear(inner, args.hidden_size, bias=False)

    # Granite 4.0-H's: silu(conv(x)) over the cached last inputs, padding kept out of them.
    convolve = Mamba2Mixer.convolve

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, heads * 2 * head_dim] -> z and x [B, T, heads, head_dim], a head's side by side
        z, hs = self.in_proj(x).unflatten(-1, (self.heads, -1)).split(self.head_dim, -1)
        hs = hs.flatten(-2)
        if cache is None:
            conv_state = hs.new_zeros(batch, hs.shape[-1], self.conv1d.kernel_size[0] - 1)
            state = hs.new_zeros(batch, self.heads, self.head_dim, self.state_size).float()
            counts = torch.full((batch,), tokens, device=x.device)
        else:
            if cache.recurrent is None:
                raise RuntimeError("Mamba layers need a cache with their state (new_cache)")
            conv_state, state = cache.recurrent.read(self.layer)
            counts = frame.counts.to(x.device)
        hs, conv_state = self.convolve(hs, conv_state, counts)
        sizes = [self.state_size, self.state_size, self.time_step_dim]
        b, c, dt = self.bcdt_proj(hs).split(sizes, -1)
        # B, C: [B, T, 1 group, d_state]
        b = _rms(b, self.B_norm_weight, self.eps)[:, :, None].float()
        c = _rms(c, self.C_norm_weight, self.eps)[:, :, None].float()
        dt = self.dt_proj(_rms(dt, self.dt_norm_weight, self.eps))
        dt = F.softplus(dt.float() + self.dt_bias.float())
        # Right padding: no step (a decay of 1, no input), so the state stays the row's.
        real = torch.arange(tokens, device=x.device)[None] < counts[:, None]
        dt = dt * real[..., None]
        a = -torch.exp(self.A_log.float())
        hs = hs.unflatten(-1, (self.heads, self.head_dim)).float()  # [B, T, heads, head_dim]
        scan = ssd_step if tokens == 1 else ssd_chunked
        y, state = scan(hs, dt, a, b, c, state.float())
        y = (y + self.D.float()[:, None] * hs) * F.silu(z.float())
        if cache is not None:
            cache.recurrent.write(self.layer, [conv_state.float(), state])
        y = y.flatten(-2).to(x.dtype)
        if cache is not None and bool((counts < tokens).any()):
            # A padded token repeats its row's last real token's output (as in
            # granitemoehybrid.Mamba2Mixer), so later layers see it as that token.
            last = torch.minimum(torch.arange(tokens, device=x.device)[None], counts[:, None] - 1)
            y = y.gather(1, last[..., None].expand(-1, -1, y.shape[-1]))
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        if args.layers_block_type[layer] == "mamba":
            self.mixer = Mamba(args, layer)
        else:
            self.mixer = attention(args, args.attention_layers.index(layer))
        self.mlp = mlp(args)
        self.pre_mixer_norm = OffsetRMSNorm(size, eps, PRE_MIXER)
        self.post_mixer_norm = OffsetRMSNorm(size, eps, POST_MIXER)
        self.pre_mlp_norm = OffsetRMSNorm(size, eps, PRE_MLP)
        self.post_mlp_norm = OffsetRMSNorm(size, eps, POST_MLP)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.post_mixer_norm(self.mixer(self.pre_mixer_norm(x), frame, cache))
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


class Body(nn.Module):
    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps, FINAL)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)
