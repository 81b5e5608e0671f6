"""RWKV-7 "Goose" (fla-hub/rwkv7-*, RWKV7ForCausalLM; BlinkDL's RWKV-7 world models): a stack
of blocks, each x + time_mix(norm(x)) then x + channel_mix(norm(x)), with no attention. The
first block normalizes the embedding first (pre_norm, BlinkDL's ln0).

Time mix: each token is mixed with the one before it (token shift: x + (x_prev - x) * x_c
for c in r, w, k, v, a, g); r, k, v are projections; low-rank maps (LoRAs) give the decay
w = exp(-e^-0.5 * sigmoid(w0 + tanh(x W1) W2)), the in-context learning rate
a = sigmoid(a0 + x A1 A2), the output gate g = sigmoid(x G1) G2, and in every block but the
first, how far v moves to the first block's v (v-first residual: sigmoid(v0 + x V1 V2)).
kk = l2norm(k * k_k) per head, and k becomes k * (1 + (a - 1) * k_a). Each head's state
S [head_size (v), head_size (k)] takes, per token, S = S diag(w) - (S kk) (kk a)^T + v k^T,
and gives out = S r; the outputs are group-normed per head (eps 64e-5, as llama.cpp and
BlinkDL's code have it), get ((r * k * r_k) summed per head) * v added, are gated by g and
projected (o_proj). Channel mix: value(relu(key(x + (x_prev - x) * x_k))^2).

Each sequence carries, per block, the last token's input to each mix and the heads' states
from one forward to the next (llmrun.models.recurrent): the cache holds no keys or values.
A prompt goes through the recurrence in chunks of tokens (wkv7_chunked), a decode step's
token alone (wkv7_token).

Reference: BlinkDL's RWKV-LM RWKV-v7 and the `rwkv` package (rwkv/model.py RWKV_x070);
flash-linear-attention's fla/models/rwkv7 and fla/layers/rwkv7.py, whose checkpoint keys
the parameters are named after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import CausalLM, Frame, StateOnly, StateOnlyArgs, args_from_config
from llmrun.models.cache import KVCache

# e^-0.5: the largest log-decay a token can take (w = exp(-DECAY_SCALE * sigmoid(...))).
DECAY_SCALE = math.exp(-0.5)
# The output group norm's eps: llama.cpp's and BlinkDL's constant, whatever the head size.
GROUP_NORM_EPS = 64e-5
# Tokens a prompt's recurrence takes at once (wkv7_chunked; its factors reach e^(CHUNK/e^0.5)).
CHUNK = 16


@dataclass
class ModelArgs(StateOnlyArgs):
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    head_dim: int = 64
    decay_low_rank_dim: int = 64
    a_low_rank_dim: int = 64
    v_low_rank_dim: int = 16
    gate_low_rank_dim: int = 128
    intermediate_size: int | None = None
    hidden_ratio: float | None = 4
    hidden_act: str = "sqrelu"
    norm_eps: float = 1e-5
    norm_bias: bool = True
    norm_first: bool = True
    value_dim: Any = None
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no attention

    def __post_init__(self) -> None:
        if self.intermediate_size is None:
            # fla's RWKV7FeedForward: hidden * ratio, rounded up to a multiple of 32
            size = int(self.hidden_size * (self.hidden_ratio or 4))
            self.intermediate_size = 32 * ((size + 31) // 32)
        if self.hidden_act != "sqrelu":
            raise UnsupportedError(f"RWKV-7 with hidden_act {self.hidden_act!r} is not supported")
        values = self.value_dim if isinstance(self.value_dim, list) else [self.value_dim]
        if any(v not in (None, self.hidden_size) for v in values):
            raise UnsupportedError(
                "RWKV-7 with value_dim other than hidden_size is not supported "
                "(llama.cpp runs none such)"
            )
        if self.hidden_size % self.head_dim:
            raise UnsupportedError(
                f"RWKV-7's hidden_size {self.hidden_size} is not a multiple of its head_dim "
                f"{self.head_dim}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each block's state of one sequence: the time mix's last input [hidden], the
        heads' states [heads, head_dim (v), head_dim (k)], the channel mix's last input."""
        h, n = self.num_heads, self.head_dim
        shapes = [(self.hidden_size,), (h, n, n), (self.hidden_size,)]
        return {i: shapes for i in range(self.num_hidden_layers)}


@dataclass
class RwkvFrame(Frame):
    """A Frame that carries the first block's values to the later blocks (v-first)."""

    v_first: torch.Tensor | None = None


class LoRA(nn.Module):
    """x -> activation(x A) B (+ bias): fla's LoRA, under its keys (lora.0, lora.2)."""

    def __init__(self, hidden: int, rank: int, activation: str | None, bias: bool = True) -> None:
        super().__init__()
        acts = {None: nn.Identity(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}
        self.lora = nn.Sequential(
            nn.Linear(hidden, rank, bias=False),
            acts[activation],
            nn.Linear(rank, hidden, bias=bias),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora(x)


def shifted(x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] moved one token later, `previous` [B, C] first: each token's predecessor."""
    return torch.cat((previous[:, None].to(x.dtype), x[:, :-1]), dim=1)


def last_real(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each row's last real token of x [B, T, C] ([B, C]), rows padded beyond `counts`."""
    return x[torch.arange(x.shape[0], device=x.device), counts.to(x.device) - 1]


def run_block(
    x: torch.Tensor,
    frame: Frame,
    cache: KVCache | None,
    layer: int,
    time_norm: nn.Module,
    time_mix: nn.Module,
    channel_norm: nn.Module,
    channel_mix: nn.Module,
) -> torch.Tensor:
    """An RWKV block (RWKV-7's, RWKV-6's) after its pre-norm: x + time_mix(time_norm(x)),
    then + channel_mix(channel_norm(x)), each mix given the token before the first (its
    input's last real token in the layer's state; zeros without a cache) and the time mix
    its heads' state, written back after each row's real tokens."""
    batch, tokens, hidden = x.shape
    if cache is None:
        shift_in = x.new_zeros(batch, hidden, dtype=torch.float32)
        size = hidden // time_mix.heads
        state = x.new_zeros(batch, time_mix.heads, size, size, dtype=torch.float32)
        shift_ffn = shift_in
    else:
        shift_in, state, shift_ffn = cache.recurrent.read(layer)
    counts = frame.counts if frame.counts is not None else torch.full((batch,), tokens)
    mixed_in = time_norm(x)
    out, state = time_mix(mixed_in, shift_in, state, frame)
    x = x + out
    ffn_in = channel_norm(x)
    x = x + channel_mix(ffn_in, shift_ffn)
    if cache is not None:
        states = [last_real(mixed_in, counts).float(), state, last_real(ffn_in, counts).float()]
        cache.recurrent.write(layer, states)
    return x


def wkv7_token(
    state: torch.Tensor,
    r: torch.Tensor,
    log_decay: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' recurrence for one token (a decode step): state [B, H, N, N] (v by k),
    the rest [B, 1, H, N] in float32 -> (outputs [B, 1, H, N], the new state).
    S = S * decay - (S kk) (kk * a)^T + v k^T, out = S r."""
    r, log_decay, k, v, kk, a = (t[:, 0] for t in (r, log_decay, k, v, kk, a))
    taken = (state @ kk[..., None]) @ (kk * a)[..., None, :]  # [B, H, N, N]
    state = state * log_decay.exp()[..., None, :] - taken + v[..., None] * k[..., None, :]
    return (state @ r[..., None])[..., 0][:, None], state


def wkv7_chunked(
    state: torch.Tensor,
    r: torch.Tensor,
    log_decay: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """wkv7_token's recurrence over T tokens ([B, T, H, N]), `chunk` tokens at a time.

    Per token S_t = S_{t-1} (diag(w_t) - kk_t (kk_t * a_t)^T) + v_t k_t^T: a diagonal plus
    low-rank (generalized delta rule) update. Within a chunk from state S, with G_i the
    summed log decays of its tokens up to i and E_i those before i, each token's recall
    u_i = S_{i-1} kk_i is S (e^E_i kk_i) - sum_{j<i} (e^E_i kk_i . e^-G_j kk_j a_j) u_j +
    sum_{j<i} (e^E_i kk_i . e^-G_j k_j) v_j: a unit lower-triangular system (the WY form
    of the chunk's low-rank products), solved once per chunk. Then out_i = S (e^G_i r_i) -
    sum_{j<=i} (e^G_i r_i . e^-G_j kk_j a_j) u_j + sum_{j<=i} (e^G_i r_i . e^-G_j k_j) v_j,
    and the chunk ends at S diag(e^G_L) + sum_j (v_j (e^(G_L - G_j) k_j)^T - u_j (e^(G_L -
    G_j) kk_j a_j)^T). A log decay is at least -DECAY_SCALE, so e^-G stays below e^(CHUNK
    * DECAY_SCALE) (e^9.7): the factored pairs neither overflow nor lose precision (RWKV-6,
    whose decays have no bound, cannot factor so). Sums of log decays are sums, never
    differences. Tokens past the end are padded with no decay and zero keys."""
    batch, tokens, heads, size = r.shape
    pad = -tokens % chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # [B, T, H, N] -> [B, chunks, H, L, N]
        padded = F.pad(t, (0, 0, 0, 0, 0, pad))
        return padded.view(batch, -1, chunk, heads, size).transpose(2, 3)

    r, log_decay, k, v, kk, a = (chunks(t) for t in (r, log_decay, k, v, kk, a))
    ones = torch.ones(chunk, chunk, dtype=r.dtype, device=r.device)
    # Rows that sum the log decays up to and including each token, before it, after it.
    sums = torch.cat((ones.tril(), ones.tril(-1), ones.triu(1)))
    eye = torch.eye(chunk, dtype=r.dtype, device=r.device)
    outputs = []
    for c in range(r.shape[1]):
        r_c, k_c, v_c, kk_c = r[:, c], k[:, c], v[:, c], kk[:, c]
        upto, before, after = (sums @ log_decay[:, c]).split(chunk, dim=-2)  # [B, H, L, N]
        removal = kk_c * a[:, c]
        # [B, H, 2L, N]: each token's removal and key brought back to the chunk's start
        earlier = torch.cat((removal, k_c), dim=-2) * torch.exp(-upto).repeat(1, 1, 2, 1)
        recalls = kk_c * before.exp()
        pairs = recalls @ earlier.transpose(-1, -2)  # [B, H, L, 2L]
        system = eye + pairs[..., :chunk].tril(-1)
        targets = recalls @ state.transpose(-1, -2) + pairs[..., chunk:].tril(-1) @ v_c
        u = torch.linalg.solve_triangular(system, targets, upper=False, unitriangular=True)
        reads = r_c * upto.exp()
        scores = reads @ earlier.transpose(-1, -2)  # [B, H, L, 2L]
        outputs.append(
            reads @ state.transpose(-1, -2)
            - scores[..., :chunk].tril() @ u
            + scores[..., chunk:].tril() @ v_c
        )
        to_end = after.exp()
        state = (
            state * upto[..., -1:, :].exp()
            - u.transpose(-1, -2) @ (removal * to_end)
            + v_c.transpose(-1, -2) @ (k_c * to_end)
        )
    out = torch.stack(outputs, dim=1).transpose(2, 3).reshape(batch, -1, heads, size)
    return out[:, :tokens], state


class TimeMix(nn.Module):
    """RWKV-7's time mix of one block (fla's RWKV7Attention, under its keys)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.layer, self.heads, self.head_dim = layer, args.num_heads, args.head_dim
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter(torch.empty(1, 1, hidden)))
        self.k_k = nn.Parameter(torch.empty(hidden))
        self.k_a = nn.Parameter(torch.empty(hidden))
        self.r_k = nn.Parameter(torch.empty(self.heads, self.head_dim))
        self.r_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.w_lora = LoRA(hidden, args.decay_low_rank_dim, "tanh")
        if layer != 0:
            self.v_lora = LoRA(hidden, args.v_low_rank_dim, None)
        self.a_lora = LoRA(hidden, args.a_low_rank_dim, None)
        self.g_lora = LoRA(hidden, args.gate_low_rank_dim, "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(self.heads, hidden, eps=GROUP_NORM_EPS)

    def forward(
        self, x: torch.Tensor, previous: torch.Tensor, state: torch.Tensor, frame: RwkvFrame
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] with the token before it `previous` [B, hidden] and the heads'
        state [B, H, N, N] -> (output, the state after the rows' real tokens)."""
        batch, tokens, hidden = x.shape
        delta = shifted(x, previous) - x
        xr, xw, xk, xv, xa, xg = (
            x + delta * mix for mix in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g)
        )
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        log_decay = -DECAY_SCALE * torch.sigmoid(self.w_lora(xw).float())
        if self.layer == 0:
            frame.v_first = v
        else:
            v = v + (frame.v_first - v) * torch.sigmoid(self.v_lora(xv))
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        heads = (batch, tokens, self.heads, self.head_dim)  # [B, T, hidden] -> per head
        kk = F.normalize((k * self.k_k).view(heads).float(), dim=-1, eps=1e-12)
        k = k * (1 + (a - 1) * self.k_a)
        real = frame.counts is not None and bool((frame.counts < tokens).any())
        if real:
            # A row's padding leaves its state as it is: no decay, nothing taken or added.
            mask = torch.arange(tokens, device=x.device)[None] < frame.counts.to(x.device)[:, None]
            log_decay = log_decay * mask[..., None]
            kk = kk * mask[..., None, None]
            k = k * mask[..., None].to(k.dtype)
        r32, k32, v32 = (t.view(heads).float() for t in (r, k, v))
        recurrence = wkv7_token if tokens == 1 else wkv7_chunked
        out, state = recurrence(
            state, r32, log_decay.view(heads), k32, v32, kk, a.view(heads).float()
        )
        norm = self.g_norm  # in float32, as the recurrence's outputs are
        out = F.group_norm(
            out.reshape(batch * tokens, hidden), self.heads, norm.weight.float(),
            norm.bias.float(), norm.eps,
        ).view(heads)  # fmt: skip
        bonus = (r32 * k32 * self.r_k.float()).sum(-1, keepdim=True) * v32
        out = ((out + bonus).reshape(batch, tokens, hidden) * g.float()).to(x.dtype)
        return self.o_proj(out), state


class ChannelMix(nn.Module):
    """value(relu(key(x + (x_prev - x) * x_k))^2) (fla's RWKV7FeedForward)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.x_k = nn.Parameter(torch.empty(args.hidden_size))
        self.key = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.value = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        xk = x + (shifted(x, previous) - x) * self.x_k
        return self.value(torch.relu(self.key(xk)).square())


class Block(nn.Module):
    """x + time_mix(attn_norm(x)), then + channel_mix(ffn_norm(x)); the first block
    normalizes its input first (pre_norm)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        norm = dict(eps=args.norm_eps, bias=args.norm_bias)
        if layer == 0 and args.norm_first:
            self.pre_norm = nn.LayerNorm(args.hidden_size, **norm)
        self.attn_norm = nn.LayerNorm(args.hidden_size, **norm)
        self.attn = TimeMix(args, layer)
        self.ffn_norm = nn.LayerNorm(args.hidden_size, **norm)
        self.ffn = ChannelMix(args)

    def forward(self, x: torch.Tensor, frame: RwkvFrame, cache: KVCache | None) -> torch.Tensor:
        if hasattr(self, "pre_norm"):
            x = self.pre_norm(x)
        mixes = (self.attn_norm, self.attn, self.ffn_norm, self.ffn)
        return run_block(x, frame, cache, self.layer, *mixes)


class Body(nn.Module):
    """The embedding, the blocks and the final norm under fla's names (embeddings, layers,
    norm)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)

    @property
    def embed_tokens(self) -> nn.Module:
        """The embedding, under the name CausalLM and the loader read."""
        return self.embeddings


class Model(StateOnly, CausalLM):
    """model -> lm_head; the KV cache holds no layers, only each block's state."""

    frame_type = RwkvFrame

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
