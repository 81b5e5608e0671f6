"""xLSTM (NX-AI/xLSTM-7b): a stack of mLSTM blocks, x + mlstm(norm(x)), then
x + ffn(norm(x)), with no attention; the logits soft-capped (output_logit_soft_cap).

An mLSTM layer projects x into per-head queries, keys and values, an output gate and
an input and a forget gate per head (their pre-activations soft-capped by
gate_soft_cap). Each head keeps a matrix memory C [qk_head, v_head], a normalizer n
[qk_head] and a stabilizer m, from zeros:
  m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)
  C_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T  (n alike, k_t)
  h_t = (q_t C_t) / (max(|q_t . n_t|, exp(-m_t)) + eps),  q_t scaled by qk_head^-0.5
then a per-head layer norm, the sigmoid of the output gate and out_proj. A prompt runs
the same recurrence in its parallel form, chunk by chunk (parallel_mlstm), in float32
as the state is kept. Each sequence carries (C, n, m) per layer from one forward to the
next (llmrun.models.recurrent): the cache holds no keys or values.

Reference: transformers/models/xlstm/modeling_xlstm.py (its native kernels; its
chunkwise kernel computes chunks of 64 tokens in bfloat16 by default, where llmrun's
parallel form stays in float32, its recurrent step's precision). Parameter names are its
checkpoint keys (backbone.*). llama.cpp has no converter for it: HF folders only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import mamba
from llmrun.models.base import Frame, StateOnlyArgs, args_from_config
from llmrun.models.cache import KVCache

# Tokens whose parallel form runs at once: its temporaries are [B, heads, CHUNK, CHUNK].
CHUNK = 256


@dataclass
class ModelArgs(StateOnlyArgs):
    vocab_size: int = 50304
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_heads: int = 8
    use_bias: bool = False
    norm_eps: float = 1e-6
    qk_dim_factor: float = 0.5
    v_dim_factor: float = 1.0
    ffn_proj_factor: float = 2.667
    ffn_round_up_to_multiple_of: int = 64
    gate_soft_cap: float = 15.0
    output_logit_soft_cap: float = 30.0
    weight_mode: str = "single"
    eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no attention

    def __post_init__(self) -> None:
        # "fused" matrices: transformers 5.25 cannot build such a model (its weight
        # init fails), so there is no reference to hold llmrun's to.
        if self.weight_mode != "single":
            raise UnsupportedError(
                f"xLSTM weight_mode {self.weight_mode!r} is not supported (supported: single)"
            )
        if self.qk_dim % self.num_heads or self.v_dim % self.num_heads:
            raise ModelFormatError(
                f"xLSTM: query/key width {self.qk_dim} and value width {self.v_dim} do not "
                f"split into {self.num_heads} heads"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        # NX-AI's config.json names the width and the depth as xlstm's own config does.
        config.setdefault("hidden_size", config.get("embedding_dim"))
        config.setdefault("num_hidden_layers", config.get("num_blocks"))
        return args_from_config(cls, config)

    # The layers' widths, as transformers' xLSTMLayer and xLSTMFeedForward size them.
    @property
    def qk_dim(self) -> int:
        return int(self.hidden_size * self.qk_dim_factor)

    @property
    def v_dim(self) -> int:
        return int(self.hidden_size * self.v_dim_factor)

    @property
    def ffn_dim(self) -> int:
        multiple = self.ffn_round_up_to_multiple_of
        return int((self.hidden_size * self.ffn_proj_factor + multiple - 1) // multiple * multiple)

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each layer's state of one sequence: per head C [qk_head, v_head], n [qk_head]
        and m [1]."""
        heads = self.num_heads
        qk, v = self.qk_dim // heads, self.v_dim // heads
        return {i: [(heads, qk, v), (heads, qk), (heads, 1)] for i in range(self.num_hidden_layers)}


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


def parallel_mlstm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    log_f: torch.Tensor,
    state: list[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mLSTM recurrence (the module docstring) over T tokens at once, from `state`
    (C [B, H, dk, dv], n [B, H, dk], m [B, H, 1]): q/k [B, H, T, dk], v [B, H, T, dv],
    input gates i and log forget gates log_f [B, H, T], all float32. Unrolled, with
    F_t = log_f_1 + .. + log_f_t, m_t = F_t + max(m_0, max_{s<=t} (i_s - F_s)) and
    C_t = exp(F_t + m_0 - m_t) C_0 + sum_{s<=t} exp(i_s + F_t - F_s - m_t) k_s v_s^T
    (n alike): every exponent is at most 0. Returns h [B, H, T, dv] and the state
    after the last token."""
    c0, n0, m0 = state
    tokens = q.shape[2]
    cumulative = log_f.cumsum(-1)  # F_t [B, H, T]
    gain = i - cumulative  # i_s - F_s
    m = cumulative + torch.maximum(m0, torch.cummax(gain, dim=-1).values)
    # [B, H, T, T]: token t's weight on token s's key and value
    log_weights = cumulative[..., :, None] + gain[..., None, :] - m[..., :, None]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).tril()
    weights = torch.exp(log_weights.masked_fill(~causal, float("-inf")))
    from_state = torch.exp(cumulative + m0 - m)  # [B, H, T]: the weight on C_0 and n_0
    q = q * q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * weights
    numerator = scores @ v + from_state[..., None] * (q @ c0)
    q_dot_n = scores.sum(-1) + from_state * (q @ n0[..., None])[..., 0]
    h = numerator / (torch.maximum(q_dot_n.abs(), torch.exp(-m)) + eps)[..., None]
    last = weights[:, :, -1]  # [B, H, T]
    c = from_state[..., -1, None, None] * c0 + (k * last[..., None]).transpose(-1, -2) @ v
    n = from_state[..., -1, None] * n0 + (k * last[..., None]).sum(2)
    return h, [c, n, m[..., -1:]]


class Norm(nn.Module):
    """xLSTM's RMS norm: x / rms(x) (in float32) * weight (+ bias where use_bias)."""

    def __init__(self, dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = ops.rms_norm(x, self.weight, self.eps)
        return x if self.bias is None else x + self.bias


class MultiHeadNorm(nn.Module):
    """A layer norm over each head's values (in float32, no affine), then the weight
    (and bias) over all heads' [B, T, H * dv]."""

    def __init__(self, heads: int, head_dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(heads * head_dim)) if bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, H, dv] -> [B, T, H * dv]."""
        dtype = self.weight.dtype
        x = F.layer_norm(h.float(), h.shape[-1:], eps=self.eps).to(dtype).flatten(-2)
        x = x * self.weight
        return x if self.bias is None else x + self.bias


class MLSTMLayer(nn.Module):
    """One block's mLSTM, its state in cache.recurrent (a row per sequence)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.heads = layer, args.num_heads
        self.qk_dim, self.v_dim = args.qk_dim, args.v_dim
        self.gate_cap, self.eps = args.gate_soft_cap, args.eps
        hidden, bias = args.hidden_size, args.use_bias
        self.q = nn.Linear(hidden, self.qk_dim, bias=bias)
        self.k = nn.Linear(hidden, self.qk_dim, bias=bias)
        self.v = nn.Linear(hidden, self.v_dim, bias=bias)
        self.ogate_preact = nn.Linear(hidden, self.v_dim, bias=bias)
        self.igate_preact = nn.Linear(hidden, self.heads, bias=True)
        self.fgate_preact = nn.Linear(hidden, self.heads, bias=True)
        head_v = self.v_dim // self.heads
        self.multihead_norm = MultiHeadNorm(self.heads, head_v, args.norm_eps, bias)
        self.out_proj = nn.Linear(self.v_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v, o = self.q(x), self.k(x), self.v(x), self.ogate_preact(x)
        i = soft_cap(self.igate_preact(x), self.gate_cap)
        f = soft_cap(self.fgate_preact(x), self.gate_cap)
        # [B, T, H * d] -> [B, H, T, d]; gates [B, T, H] -> [B, H, T], all float32
        q, k, v = (
            t.reshape(batch, tokens, self.heads, -1).transpose(1, 2).float() for t in (q, k, v)
        )
        i, log_f = i.transpose(1, 2).float(), F.logsigmoid(f.transpose(1, 2).float())
        if cache is None:
            heads, qk, dv = self.heads, q.shape[-1], v.shape[-1]
            state = [
                x.new_zeros(batch, heads, qk, dv, dtype=torch.float32),
                x.new_zeros(batch, heads, qk, dtype=torch.float32),
                x.new_zeros(batch, heads, 1, dtype=torch.float32),
            ]
        else:
            state = cache.recurrent.read(self.layer)
            # A row's padding (beyond its real tokens) leaves its state as it is: it
            # forgets nothing (log f = 0) and takes nothing in (i = -inf).
            padding = (
                torch.arange(tokens, device=x.device)[None] >= frame.counts.to(x.device)[:, None]
            )
            i = i.masked_fill(padding[:, None], float("-inf"))
            log_f = log_f.masked_fill(padding[:, None], 0.0)
        outputs = []
        for start in range(0, tokens, CHUNK):
            part = slice(start, start + CHUNK)
            h, state = parallel_mlstm(
                q[:, :, part],
                k[:, :, part],
                v[:, :, part],
                i[..., part],
                log_f[..., part],
                state,
                self.eps,
            )
            outputs.append(h)
        if cache is not None:
            cache.recurrent.write(self.layer, state)
        h = torch.cat(outputs, dim=2).transpose(1, 2).to(x.dtype)  # [B, T, H, dv]
        return self.out_proj(torch.sigmoid(o) * self.multihead_norm(h))


class FeedForward(nn.Module):
    """proj_down(silu(proj_up_gate(x)) * proj_up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden, inner, bias = args.hidden_size, args.ffn_dim, args.use_bias
        self.proj_up_gate = nn.Linear(hidden, inner, bias=bias)
        self.proj_up = nn.Linear(hidden, inner, bias=bias)
        self.proj_down = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_down(ops.gated(F.silu, self.proj_up_gate(x), self.proj_up(x)))


class Block(nn.Module):
    """x + mlstm(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        dim, eps, bias = args.hidden_size, args.norm_eps, args.use_bias
        self.norm_mlstm = Norm(dim, eps, bias)
        self.mlstm_layer = MLSTMLayer(args, layer)
        self.norm_ffn = Norm(dim, eps, bias)
        self.ffn = FeedForward(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.mlstm_layer(self.norm_mlstm(x), frame, cache)
        return x + self.ffn(self.norm_ffn(x))


class Backbone(nn.Module):
    """The embedding, the blocks and the final norm under their Hugging Face names
    (embeddings, blocks, out_norm)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.blocks = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        # transformers' out_norm takes no bias, whatever use_bias says.
        self.out_norm = Norm(args.hidden_size, args.norm_eps, bias=False)

    @property
    def embed_tokens(self) -> nn.Module:
        """The embedding, under the name CausalLM and the loader read."""
        return self.embeddings

    @property
    def layers(self) -> nn.ModuleList:
        """The blocks, under the name llmrun.models.base.run_layers reads."""
        return self.blocks

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.out_norm


class Model(mamba.Model):
    """backbone -> lm_head -> soft cap (mamba.Model's frame, under the same names); the KV
    cache holds no layers, only each block's state."""

    backbone_type = Backbone

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """CausalLM.forward's logits, soft-capped to output_logit_soft_cap."""
        logits = super().forward(input_ids, positions, cache, last_only, last, static, images)
        return soft_cap(logits, self.args.output_logit_soft_cap)
