"""Qwen3.5 (dense: Qwen3.5-0.8B ... 27B): a hybrid of Gated DeltaNet linear attention and
gated full attention, three linear layers to each full one by default.

A linear-attention layer projects q, k, v (through a causal depthwise convolution of
linear_conv_kernel_dim taps and SiLU), a gate z, and per value head beta = sigmoid(b) and
a log decay g = -exp(A_log) * softplus(a + dt_bias). Its state, a [k_dim, v_dim] matrix
per value head, follows the gated delta rule: S <- exp(g) S, then S += k (beta (v - S^T
k))^T, and the output S^T q goes through an RMSNorm gated by silu(z). Queries and keys
are L2-normalized, and each of their heads serves linear_num_value_heads /
linear_num_key_heads value heads. A full-attention layer is Qwen3's (an RMSNorm on each
query and key head) with queries twice as wide, their second half a gate: the output is
multiplied by sigmoid(gate). RoPE turns the first quarter of each head (partial_rotary_
factor); the reference's M-RoPE gives its three sections the same position for text, so
it is ordinary RoPE for text; a prompt with images (Qwen3.5's own, llmrun.models.mrope)
turns the full-attention layers by interleaved M-RoPE. Every RMSNorm but the gated one
scales by 1 + weight.

Reference: transformers/models/qwen3_5/modeling_qwen3_5.py (Qwen3_5ForCausalLM, and the
language model of Qwen3_5ForConditionalGeneration). The recurrent layers keep their state
in cache.recurrent (llmrun.models.recurrent); the KV cache holds the full-attention
layers only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import mrope
from llmrun.models.base import (
    Frame,
    GatedMLP,
    GemmaRMSNorm,
    Hybrid,
    args_from_config,
    attend,
)
from llmrun.models.cache import KVCache

LAYER_TYPES = ("linear_attention", "full_attention")
CHUNK = 64  # tokens the chunked delta rule takes at once
L2_EPS = 1e-6  # the reference's l2norm, as the FLA kernels compute it


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 12288
    num_key_value_heads: int | None = None
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    # llama.cpp's GGUFs hold the value heads tiled (v head j with k head j % key heads)
    # rather than grouped (with k head j // (value heads / key heads)): its converter
    # reorders them for ggml's broadcast. Set by the GGUF reader; the weights stay as stored.
    tiled_value_heads: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.layer_types is None:
            interval = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise UnsupportedError(
                    f"Qwen3.5 layer type {kind!r} is not supported "
                    f"(supported: {', '.join(LAYER_TYPES)})"
                )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {self.num_hidden_layers}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelFormatError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple "
                f"of linear_num_key_heads ({self.linear_num_key_heads})"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # A Qwen3_5ForConditionalGeneration config: its language model.
        config = dict(config.get("text_config") or config)
        config["rope_parameters"] = dict(config.get("rope_parameters") or {})
        # transformers' default for Qwen3.5 configs that leave it out.
        config["rope_parameters"].setdefault("partial_rotary_factor", 0.25)
        return args_from_config(cls, config)

    @property
    def attention_layers(self) -> list[int]:
        """The full-attention layers, in order: the KV cache's layers."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    def layer_windows(self) -> list[int | None]:
        """The KV cache's layers' windows: none, one per full-attention layer (what
        kv_cache_bytes counts)."""
        return [None] * len(self.attention_layers)

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each linear-attention layer's state per sequence: the convolution's last
        inputs [channels, kernel - 1] and the delta rule's [value heads, k_dim, v_dim]."""
        channels = 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )
        matrix = (
            self.linear_num_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
        )
        return {
            i: [(channels, self.linear_conv_kernel_dim - 1), matrix]
            for i, kind in enumerate(self.layer_types)
            if kind == "linear_attention"
        }


class Attention(nn.Module):
    """Qwen3's attention with a sigmoid gate on its output, taken from the queries'
    projection (each head's query, then its gate)."""

    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.index = index  # among the attention layers: the KV cache's layer
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        bias = args.attention_bias
        width = self.n_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, 2 * width, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(width, args.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H * 2D] -> [B, T, H, 2D]: each head's query, then its gate
        query, gate = self.q_proj(x).view(batch, tokens, self.n_heads, -1).chunk(2, dim=-1)
        q = self.q_norm(query).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        out = self.attend(q, k, v, x, frame, cache)  # [B, T, H*D]
        return self.o_proj(out * torch.sigmoid(gate.reshape(batch, tokens, -1)))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        x: torch.Tensor,
        frame: Frame,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """The rotated q [B, H, T, D] over the keys and values k/v [B, Hkv, T, D] and the
        cache's: [B, T, H*D]. A hook: Qwen4-Exp's indexer (given the layer's input x)
        chooses the keys each query attends to."""
        return attend(q, k, v, self.index, frame, cache)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * act(gate), act silu unless given, in float32 (the
    reference's Qwen3_5RMSNormGated: a plain weight, not 1 + weight)."""

    def __init__(self, dim: int, eps: float, act: Callable = F.silu) -> None:
        super().__init__()
        self.eps = eps
        self.act = act
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight * normed * self.act(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention layer (see the module docstring), its state carried in
    cache.recurrent between forwards."""

    beta_scale = 1.0  # OLMo Hybrid's doubles its betas (llmrun.models.olmo_hybrid)

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.k_heads, self.v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.k_dim, self.v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_width = self.k_heads * self.k_dim
        self.value_width = self.v_heads * self.v_dim
        self.tiled = args.tiled_value_heads
        channels = 2 * self.key_width + self.value_width
        self.kernel = args.linear_conv_kernel_dim
        hidden = args.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_width, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.v_heads, bias=False)
        # Depthwise: weight [channels, 1, kernel], applied by F.conv1d in forward.
        self.conv1d = nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_width, hidden, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        mixed = self.in_proj_qkv(x)
        if cache is None:
            conv_state = mixed.new_zeros(batch, mixed.shape[-1], self.kernel - 1)
            state, counts = None, torch.full((batch,), tokens, device=x.device)
        else:
            conv_state, state = cache.recurrent.read(self.layer)
            counts = frame.counts
            y = self._native_step(x, mixed, conv_state, state, counts) if tokens == 1 else None
            if y is not None:
                cache.recurrent.write(self.layer, [conv_state, state])
                return self.out_proj(y)
        mixed = mixed.transpose(1, 2)  # [B, channels, T]
        inputs = torch.cat((conv_state.to(mixed.dtype), mixed), dim=-1)  # [B, C, K-1+T]
        if tokens == 1:  # one output per channel: a dot product with its taps
            conv = F.silu((inputs * self.conv1d.weight[:, 0]).sum(dim=-1, keepdim=True))
        else:
            conv = F.silu(F.conv1d(inputs, self.conv1d.weight, groups=inputs.shape[1]))
        q, k, v = conv.transpose(1, 2).split(
            [self.key_width, self.key_width, self.value_width], dim=-1
        )
        real = torch.arange(tokens, device=x.device) < counts[:, None]  # [B, T]
        # Padding (rows padded on the right) leaves the state as it is: no decay, no write.
        beta = torch.sigmoid(self.in_proj_b(x).float()) * self.beta_scale * real[..., None]
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        decay = decay * real[..., None]
        # [B, T, heads * dim] -> [B, heads, T, dim], queries and keys for each value head
        q = self._per_value_head(q.reshape(batch, tokens, self.k_heads, self.k_dim))
        k = self._per_value_head(k.reshape(batch, tokens, self.k_heads, self.k_dim))
        v = v.reshape(batch, tokens, self.v_heads, self.v_dim).transpose(1, 2).float()
        q = _l2_normalize(q) * self.k_dim**-0.5
        k = _l2_normalize(k)
        if state is None:
            state = v.new_zeros(batch, self.v_heads, self.k_dim, self.v_dim)
        rule = recurrent_delta_rule if tokens == 1 else chunked_delta_rule
        out, state = rule(q, k, v, decay.transpose(1, 2), beta.transpose(1, 2), state.float())
        if cache is not None:
            # Each row's last kernel - 1 inputs up to its last real token.
            taps = counts[:, None] + torch.arange(self.kernel - 1, device=x.device)
            kept = inputs.gather(2, taps[:, None].expand(-1, inputs.shape[1], -1))
            cache.recurrent.write(self.layer, [kept, state])
        z = self.in_proj_z(x).view(batch, tokens, self.v_heads, self.v_dim)
        out = self.norm(out.transpose(1, 2).to(x.dtype), z)  # [B, T, Hv, Dv]
        return self.out_proj(out.reshape(batch, tokens, self.value_width))

    def _native_step(
        self,
        x: torch.Tensor,
        mixed: torch.Tensor,
        conv_state: torch.Tensor,
        state: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor | None:
        """One token natively (llmrun.ops.gated_delta_step: the states updated in place),
        or None where the native op cannot take it."""
        if not ops.native_takes(mixed, conv_state, state):
            return None
        return ops.gated_delta_step(
            mixed,
            conv_state,
            self.conv1d.weight,
            self.in_proj_a(x),
            self.in_proj_b(x),
            -self.A_log.float().exp(),
            self.dt_bias,
            state,
            self.in_proj_z(x),
            self.norm.weight,
            counts,
            self.k_heads,
            self.tiled,
            L2_EPS,
            self.norm.eps,
        )

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, k heads, D] -> [B, v heads, T, D] in float32, each key head repeated
        for the value heads it serves (grouped, or tiled as llama.cpp's files hold them)."""
        repeats = self.v_heads // self.k_heads
        if self.tiled:
            x = x.repeat(1, 1, repeats, 1)
        else:
            x = x.repeat_interleave(repeats, dim=2)
        return x.transpose(1, 2).float()


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time: q, k [B, H, T, Dk], v [B, H, T, Dv],
    log decay and beta [B, H, T], state [B, H, Dk, Dv]. Returns the outputs [B, H, T, Dv]
    and the state after the last token."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * decay[:, :, t, None, None].exp()
        k_t = k[:, :, t, None]  # [B, H, 1, Dk]
        # What the state recalls for k_t, corrected toward v_t by beta.
        error = (v[:, :, t, None] - k_t @ state) * beta[:, :, t, None, None]  # [B, H, 1, Dv]
        state.addcmul_(k_t.transpose(-1, -2), error)
        outputs.append(q[:, :, t, None] @ state)
    return torch.cat(outputs, dim=2), state


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_delta_rule's outputs and final state, computed `chunk` tokens at a time.

    Within a chunk starting from state S, with G_i the summed log decay of its tokens up
    to i, the state's corrections u_i = beta_i (v_i - exp(G_i) S^T k_i - sum_{j<i}
    exp(G_i - G_j) (k_i . k_j) u_j) form a unit lower-triangular system (I + A) U =
    beta V - beta exp(G) K S, solved once per chunk; then each output is exp(G_i) S^T q_i
    + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j, and the chunk ends at exp(G_L) S + sum_j
    exp(G_L - G_j) k_j u_j^T. Tokens past the end are padded with beta = 0 and no decay,
    which leave the state alone."""
    batch, heads, tokens, _ = q.shape
    chunk = min(chunk, tokens)
    pad = -tokens % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    decay, beta = (F.pad(t, (0, pad)) for t in (decay, beta))

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # [B, H, T, ...] -> [B, H, chunks, chunk, ...]
        return t.reshape(batch, heads, -1, chunk, *t.shape[3:])

    q, k, v, decay, beta = (chunks(t) for t in (q, k, v, decay, beta))
    summed = decay.cumsum(dim=-1)  # G [B, H, N, L]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    gaps = (summed[..., :, None] - summed[..., None, :]).masked_fill(~causal, float("-inf"))
    decays = gaps.exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * decays).tril(-1) + torch.eye(chunk, device=q.device)
    rise = summed.exp()[..., None]
    values = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    reads = torch.linalg.solve_triangular(system, k_beta * rise, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decays
    to_end = (summed[..., -1:] - summed).exp()[..., None]
    outputs = []
    for n in range(q.shape[2]):
        u = values[:, :, n] - reads[:, :, n] @ state
        outputs.append((q[:, :, n] * rise[:, :, n]) @ state + scores[:, :, n] @ u)
        state = state * summed[:, :, n, -1, None, None].exp() + (
            (k[:, :, n] * to_end[:, :, n]).transpose(-1, -2) @ u
        )
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, v.shape[-1])
    return out[:, :, :tokens], state


class DecoderLayer(nn.Module):
    """Pre-norm residual block whose mixer is a Gated DeltaNet or a gated attention."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        if args.layer_types[layer] == "linear_attention":
            self.linear_attn = GatedDeltaNet(args, layer)
        else:
            self.self_attn = attention(args, args.attention_layers.index(layer))
        self.mlp = self.feed_forward(args, layer, mlp)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def feed_forward(self, args: ModelArgs, layer: int, mlp: type) -> nn.Module:
        """The layer's feed-forward (Qwen3-Next's are dense in some layers)."""
        return mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x = x + mixer(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(Hybrid, mrope.MRopeLM):
    """Qwen3.5's language model; `images`: Qwen3.5's image tokens turn by M-RoPE
    (MiniCPM-V 4.6's, ImageTokens, by their places)."""

    interleaved = True  # Qwen3_5TextRotaryEmbedding interleaves whatever the config says

    def __init__(self, args: ModelArgs, mlp: type = GatedMLP, layer: type = DecoderLayer) -> None:
        norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        super().__init__(args, Attention, mlp, layer, norm)
