"""Zyphra Zamba (Zamba-7B-v1; ZambaForCausalLM), Zamba2's forerunner: a stack of Mamba-1
layers, each x + mamba(norm(x)), some of them "hybrid", running the one shared
transformer block on [x, the token embeddings] and adding linear(its output) to the
mixer's input (zamba2.py's layout: one block, no adapters, no RoPE, a gated MLP of
gate_proj and up_proj).

The mixer is Mamba-1 in n_mamba_heads independent heads: in_proj's rows interleave the
input and the gate (even rows the input, odd ones the gate), one causal depthwise
convolution and SiLU over all of them, then per head of inner / n_mamba_heads features
its own x_proj (time step rank, B, C) and dt_proj, its A and D, the selective scan
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,  y_t = C_t . h_t + D x_t,
gated by silu(gate), and out_proj over the heads side by side. Each sequence keeps the
convolution's last inputs and every head's h in cache.recurrent.

Reference: transformers/models/zamba/modeling_zamba.py. Parameter names are its keys;
the shared block is registered at the first hybrid layer (as save_pretrained writes it;
llmrun/loading/zamba2.py drops copies at the others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import zamba2
from llmrun.models.base import (
    Frame,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
)
from llmrun.models.cache import KVCache
from llmrun.models.mamba import SCAN_CHUNK, selective_scan

MAMBA, HYBRID = zamba2.MAMBA, zamba2.HYBRID


@dataclass
class ModelArgs:
    hidden_size: int = 3712
    vocab_size: int = 32000
    num_hidden_layers: int = 76
    layers_block_type: list[str] | None = None  # None: from the period and offset
    attn_layer_period: int = 6
    attn_layer_offset: int = 4
    intermediate_size: int = 14848
    hidden_act: str = "gelu"
    hidden_mamba_act: str = "silu"
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    attention_hidden_size: int | None = None  # None: 2 * hidden_size, all it can be
    attention_head_dim: int | None = None  # None: 2 * hidden_size / num_attention_heads
    n_mamba_heads: int = 2
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no RoPE

    # zamba2.Attention's switches: Zamba's attention has neither.
    use_mem_rope = False
    use_shared_attention_adapter = False

    def __post_init__(self) -> None:
        if self.layers_block_type is None:
            # ZambaConfig's default: two Mamba layers, a hybrid one, then the period.
            period, offset = self.attn_layer_period, self.attn_layer_offset
            self.layers_block_type = [MAMBA, MAMBA, HYBRID] + [
                HYBRID if i % period == offset else MAMBA for i in range(self.num_hidden_layers - 3)
            ]
        self.layers_block_type = zamba2.layer_kinds({"layers_block_type": self.layers_block_type})
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.mamba_dt_rank == "auto":
            self.mamba_dt_rank = math.ceil(self.hidden_size / 16)
        width = self.attention_hidden_size or 2 * self.hidden_size
        if width != 2 * self.hidden_size:
            raise ModelFormatError(
                f"Zamba's attention takes [hidden, embeddings], 2 * {self.hidden_size} wide; "
                f"attention_hidden_size is {width}"
            )
        if self.hidden_mamba_act != "silu":
            raise UnsupportedError(
                f"Zamba hidden_mamba_act {self.hidden_mamba_act!r} is not supported (silu only)"
            )
        if (self.mamba_expand * self.hidden_size) % self.n_mamba_heads:
            raise ModelFormatError(
                f"Zamba's Mamba inner size {self.mamba_expand * self.hidden_size} does not split "
                f"into {self.n_mamba_heads} heads"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("layers_block_type") is None and config.get("layer_types") is not None:
            config = {**config, "layers_block_type": config["layer_types"]}
        return args_from_config(cls, config)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or 2 * self.hidden_size // self.num_attention_heads

    @property
    def attention_layers(self) -> list[int]:
        """The hybrid layers' indices: each keeps its own keys and values, in order."""
        return [i for i, kind in enumerate(self.layers_block_type) if kind == HYBRID]

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Every layer's state of one sequence: the convolution's last inputs [inner,
        d_conv - 1] and the heads' h side by side [inner, d_state]."""
        inner = self.mamba_expand * self.hidden_size
        shapes = [(inner, self.mamba_d_conv - 1), (inner, self.mamba_d_state)]
        return dict.fromkeys(range(len(self.layers_block_type)), shapes)

    def layer_windows(self) -> list[None]:
        """One entry per KV cache layer: the hybrid layers, all full."""
        return [None] * len(self.attention_layers)


class MambaMixer(nn.Module):
    """Mamba-1 in independent heads (see the module's docstring); `layer` is the model's
    layer index, under which cache.recurrent keeps its state."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        inner = args.mamba_expand * args.hidden_size
        self.heads, self.head_dim = args.n_mamba_heads, inner // args.n_mamba_heads
        self.rank, self.n = args.mamba_dt_rank, args.mamba_d_state
        bias = args.mamba_proj_bias
        self.in_proj = nn.Linear(args.hidden_size, 2 * inner, bias=bias)
        self.conv1d = nn.Conv1d(
            inner, inner, args.mamba_d_conv, groups=inner, bias=args.mamba_conv_bias
        )
        self.x_proj_weight = nn.Parameter(
            torch.empty(self.heads, self.rank + 2 * self.n, self.head_dim)
        )
        self.dt_proj_weight = nn.Parameter(torch.empty(self.heads, self.head_dim, self.rank))
        self.dt_proj_bias = nn.Parameter(torch.empty(self.heads, self.head_dim))
        self.A_log = nn.Parameter(torch.empty(self.heads, self.head_dim, self.n))
        self.D = nn.Parameter(torch.empty(self.heads, self.head_dim))
        self.out_proj = nn.Linear(inner, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, 2 * inner] -> input and gate [B, T, inner]: rows interleaved
        u, gate = self.in_proj(x).unflatten(-1, (-1, 2)).unbind(-1)
        inputs = u.transpose(1, 2)  # [B, inner, T]
        kept = self.conv1d.kernel_size[0] - 1
        if cache is None:
            past = inputs.new_zeros(*inputs.shape[:2], kept)
            h = inputs.new_zeros(batch, inputs.shape[1], self.n, dtype=torch.float32)
            counts = torch.full((batch,), tokens, device=x.device)
        else:
            if cache.recurrent is None:
                raise RuntimeError("Zamba's Mamba layers need a cache with their state")
            past, h = cache.recurrent.read(self.layer)
            counts = frame.counts.to(x.device)
        window = torch.cat((past.to(inputs.dtype), inputs), dim=-1)  # [B, inner, kept + T]
        u = F.silu(F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=window.shape[1]))
        heads = u.transpose(1, 2).unflatten(-1, (self.heads, self.head_dim))  # [B, T, H, P]

        params = torch.einsum("bthp,hkp->bthk", heads, self.x_proj_weight)
        dt, b, c = params.split([self.rank, self.n, self.n], dim=-1)  # [B, T, H, R | N | N]
        dt = torch.einsum("bthr,hpr->bthp", dt, self.dt_proj_weight) + self.dt_proj_bias
        dt = F.softplus(dt.float())  # [B, T, H, P]
        real = torch.arange(tokens, device=x.device)[None] < counts[:, None]
        dt = dt * real[..., None, None]  # padding: no decay, nothing taken in
        a = -torch.exp(self.A_log.float())  # [H, P, N]
        u32, b32, c32 = heads.float(), b.float(), c.float()
        outputs = []
        for start in range(0, tokens, SCAN_CHUNK):
            part = slice(start, start + SCAN_CHUNK)
            step = dt[:, part, ..., None]  # [B, t, H, P, 1]
            decay = torch.exp(step * a).flatten(2, 3)  # [B, t, inner, N]
            taken = (step * u32[:, part, ..., None] * b32[:, part, :, None, :]).flatten(2, 3)
            states, h = selective_scan(decay, taken, h)
            states = states.unflatten(2, (self.heads, self.head_dim))  # [B, t, H, P, N]
            outputs.append(torch.einsum("bthpn,bthn->bthp", states, c32[:, part]))
        y = torch.cat(outputs, dim=1) + u32 * self.D.float()
        y = (y.flatten(2) * F.silu(gate.float())).to(x.dtype)  # [B, T, inner]

        if cache is not None:
            # Each row's convolution state: the last `kept` inputs up to its last real token.
            starts = counts[:, None] + torch.arange(kept, device=x.device)
            conv_state = window.gather(2, starts[:, None, :].expand(-1, window.shape[1], -1))
            cache.recurrent.write(self.layer, [conv_state.float(), h])
            if bool((counts < tokens).any()):
                # A padded token repeats its row's last real token: it gets that token's
                # output, so the attention's keys and values at that position stay its.
                last = torch.minimum(
                    torch.arange(tokens, device=x.device)[None], counts[:, None] - 1
                )
                y = y.gather(1, last[..., None].expand(-1, -1, y.shape[-1]))
        return self.out_proj(y)


class SharedTransformer(nn.Module):
    """feed_forward(pre_ff_layernorm(self_attn(input_layernorm([x, embeddings])))):
    no residual inside."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(2 * args.hidden_size, args.rms_norm_eps)
        self.self_attn = zamba2.Attention(args, 0)
        self.pre_ff_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = GatedMLP(args)

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, rank: int
    ) -> torch.Tensor:
        """`rank`: the calling hybrid layer's among them (its KV cache layer)."""
        h = self.input_layernorm(torch.cat((x, frame.embeddings), dim=-1))
        return self.feed_forward(self.pre_ff_layernorm(self.self_attn(h, frame, cache, rank)))


class HybridLayer(nn.Module):
    """The shared block's output through `linear`, added to the Mamba layer's input."""

    def __init__(self, args: ModelArgs, layer: int, block: SharedTransformer, first: bool) -> None:
        """`first`: whether this is the first hybrid layer, which registers `block` (the
        others hold it unregistered: one copy of its weights)."""
        super().__init__()
        self.rank = args.attention_layers.index(layer)
        if first:
            self.shared_transf = block
        self.block = (block,)  # a tuple: not a submodule, so not a second set of weights
        self.linear = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.mamba_decoder = zamba2.MambaLayer(args, MambaMixer(args, layer))

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        block = self.block[0](x, frame, cache, self.rank)
        return self.mamba_decoder(x, frame, cache, self.linear(block))


class Body(nn.Module):
    """The embedding, the layers (the shared block built once), the final norm under its
    Hugging Face name (final_layernorm) and RoPE tables the attention does not use
    (CausalLM's frame computes them)."""

    def __init__(
        self, args: ModelArgs, attention: None, mlp: None, layer: None, norm: None
    ) -> None:
        """`attention`, `mlp`, `layer`, `norm`: None (CausalLM's arguments)."""
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        block = SharedTransformer(args)
        self.layers = nn.ModuleList(
            zamba2.MambaLayer(args, MambaMixer(args, i))
            if kind == MAMBA
            else HybridLayer(args, i, block, first=i == args.attention_layers[0])
            for i, kind in enumerate(args.layers_block_type)
        )
        self.final_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            {"rope_type": "default", "rope_theta": 10000.0}, args.head_dim, 0
        )

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.final_layernorm


class Model(zamba2.Model):
    """zamba2.Model with this module's body."""

    body_type = Body
