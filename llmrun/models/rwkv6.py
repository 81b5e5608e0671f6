"""RWKV-6 "Finch" (BlinkDL's RWKV-6 world models, RWKV/v6-Finch-*-HF): a stack of blocks,
each x + time_mix(ln1(x)) then x + channel_mix(ln2(x)), with no attention; the first block
normalizes the embedding first (pre_ln).

Time mix: each token is mixed with the one before it through data-dependent amounts
(ddlerp): m = tanh((x + dx * maa_x) W1) W2 gives five offsets, and x_c = x + dx * (maa_c +
m_c) for c in w, k, v, r, g (dx = x_prev - x). r, k, v are projections, g = silu(gate);
the decay w = exp(-exp(time_decay + tanh(x_w D1) D2)) per channel. Each head's state
S [head_size (k), head_size (v)] gives out = r (u * k^T v + S) (u: time_faaaa, the bonus of
the current token) and takes S = k^T v + diag(w) S. The outputs are group-normed per head
(eps 64e-5), gated by g and projected (output). Channel mix: sigmoid(receptance(x_r)) *
value(relu(key(x_k))^2).

GGUFs hold the output matrices of block i divided by 2^(i // rescale_every) (as BlinkDL's
fp16 inference keeps them, to stay in range), and llama.cpp halves the hidden state after
every rescale_every blocks; the model does the same (the norms make it otherwise moot).

Each sequence carries, per block, the last token's input to each mix and the heads' states
(llmrun.models.recurrent): the cache holds no keys or values. A prompt goes through the
recurrence in chunks of tokens (wkv6_chunked), a decode step's token alone (wkv6_token).

Reference: BlinkDL's RWKV-LM RWKV-v6 and the `rwkv` package (rwkv/model.py, att_seq_v6_0
and ffn_seq_v6); the parameters carry the Hugging Face port's names (RWKV/v6-Finch-*-HF,
rwkv.blocks.N.attention.time_maa_x, ...) under model.layers.N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import CausalLM, Frame, StateOnly, StateOnlyArgs, args_from_config
from llmrun.models.cache import KVCache
from llmrun.models.rwkv7 import GROUP_NORM_EPS, run_block, shifted

MIXES = ("w", "k", "v", "r", "g")  # the order of the ddlerp's five offsets
# The prompt's recurrence (wkv6_chunked) takes CHUNK tokens at once, in blocks of BLOCK.
CHUNK, BLOCK = 16, 4


@dataclass
class ModelArgs(StateOnlyArgs):
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    head_size: int = 64
    attention_hidden_size: int | None = None
    intermediate_size: int | None = None
    layer_norm_epsilon: float = 1e-5
    # Halve the hidden state after every rescale_every blocks (0: never): GGUFs' weights.
    rescale_every: int = 0
    time_mix_extra_dim: int = 32
    time_decay_extra_dim: int = 64
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no attention

    def __post_init__(self) -> None:
        if self.attention_hidden_size not in (None, self.hidden_size):
            raise UnsupportedError("RWKV-6 with attention_hidden_size other than hidden_size")
        if self.intermediate_size is None:
            # llama.cpp's converter's default (and the Hugging Face port's)
            self.intermediate_size = int((self.hidden_size * 3.5) // 32 * 32)
        if self.hidden_size % self.head_size:
            raise UnsupportedError(
                f"RWKV-6's hidden_size {self.hidden_size} is not a multiple of its head_size "
                f"{self.head_size}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_size

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each block's state of one sequence: the time mix's last input [hidden], the
        heads' states [heads, head_size (k), head_size (v)], the channel mix's last input."""
        h, n = self.num_heads, self.head_size
        shapes = [(self.hidden_size,), (h, n, n), (self.hidden_size,)]
        return {i: shapes for i in range(self.num_hidden_layers)}


def wkv6_token(
    state: torch.Tensor,
    r: torch.Tensor,
    log_decay: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bonus: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' recurrence for one token (a decode step): state [B, H, N, N] (k by v),
    r, log decay, k, v [B, 1, H, N] and bonus [H, N] in float32 -> (outputs [B, 1, H, N],
    the new state). out = r (bonus * k^T v + S), S = k^T v + decay * S."""
    r, log_decay, k, v = (t[:, 0] for t in (r, log_decay, k, v))
    kv = k[..., None] * v[..., None, :]  # [B, H, N (k), N (v)]
    out = (r[..., None, :] @ (bonus[..., None] * kv + state))[..., 0, :]
    return out[:, None], kv + log_decay.exp()[..., None] * state


def summing_rows(n: int, like: torch.Tensor) -> torch.Tensor:
    """[2n + n^2 + 1, n] rows of 0 and 1 that, times x [..., n, C], sum x per channel over
    the positions before each i (n rows), after each i (n), strictly between each j and i
    (n^2, row i * n + j; none where j >= i) and all of them (1)."""
    i = torch.arange(n, device=like.device)
    before = i[:, None] > i[None]  # [i, m]: m < i
    between = (i[None, :, None] < i) & (i[:, None, None] > i)  # [i, j, m]: j < m < i
    every = torch.ones(1, n, dtype=torch.bool, device=like.device)
    return torch.cat((before, before.T, between.view(n * n, n), every)).to(like.dtype)


def split_sums(sums: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """summing_rows(n) @ x -> the sums before [..., n, C], after [..., n, C], between
    [..., n (i), n (j), C] and of all [..., C]."""
    before, after, between, every = sums.split((n, n, n * n, 1), dim=-2)
    return before, after, between.unflatten(-2, (n, n)), every[..., 0, :]


def wkv6_chunked(
    state: torch.Tensor,
    r: torch.Tensor,
    log_decay: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bonus: torch.Tensor,
    chunk: int = CHUNK,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """wkv6_token's recurrence over T tokens ([B, T, H, N]), `chunk` tokens at a time in
    blocks of `block` (gated linear attention's chunked form, as flash-linear-attention
    computes it).

    Within a chunk from state S, token i gives (e^E_i r_i) S + (r_i . bonus k_i) v_i +
    sum_{j<i} (r_i . e^(E_i - G_j) k_j) v_j, with E_i the log decays of the chunk's tokens
    before i summed per channel and G_j those up to j; the chunk ends at diag(e^G_L) S +
    sum_j (e^(G_L - G_j) k_j)^T v_j. RWKV-6's decays have no bound (a log decay is -exp(...)), so no sum
    of log decays is formed as a difference of two (that overflows, or cancels to noise,
    where a chunk decays far): each is summed from its own terms, all at most 0, and each
    factor e^sum is at most 1. A pair of tokens in different blocks factors at the start
    of i's block, e^(its block's start .. i) times e^(j .. that start), through matrix
    products; a pair in the same block is weighed per channel. Tokens past the end are
    padded with no decay and zero keys."""
    batch, tokens, heads, size = r.shape
    pad, blocks = -tokens % chunk, chunk // block
    # exp(-1e4) is 0, as is exp of anything summed with it; -inf (a decay past e^-e^88)
    # would turn the 0 rows of the sums into NaN.
    log_decay = log_decay.clamp(min=-1e4)

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # [B, T, H, N] -> [B, chunks, H, blocks, block, N]
        padded = F.pad(t, (0, 0, 0, 0, 0, pad)).view(batch, -1, chunk, heads, size)
        return padded.transpose(2, 3).unflatten(3, (blocks, block))

    r, log_decay, k, v = (chunks(t) for t in (r, log_decay, k, v))
    in_block, in_chunk = summing_rows(block, r), summing_rows(blocks, r)
    lower = torch.ones(block, block, dtype=r.dtype, device=r.device).tril(-1)
    earlier_block = in_chunk[:blocks, :, None, None].transpose(1, 2)  # [a, 1, b, 1]: b < a
    outputs = []
    for c in range(r.shape[1]):
        r_c, k_c, v_c = r[:, c], k[:, c], v[:, c]  # [B, H, blocks, block, N]
        before, after, between, totals = split_sums(in_block @ log_decay[:, c], block)
        blocks_before, blocks_after, blocks_between, total = split_sums(in_chunk @ totals, blocks)
        queries = r_c * before.exp()  # from the start of the token's block
        keys = k_c * after.exp()  # to the end of the token's block
        # [B, H, a, b, block, N]: block b's keys brought to the start of block a (if b < a)
        reaching = keys[:, :, None] * blocks_between[..., None, :].exp()
        scores = queries @ reaching.flatten(3, 4).transpose(-1, -2)  # [B, H, a, i, b * j]
        scores = scores.unflatten(-1, (blocks, block)) * earlier_block
        within = (r_c[..., :, None, :] * k_c[..., None, :, :] * between.exp()).sum(-1) * lower
        within = within + torch.diag_embed((r_c * bonus[:, None, None] * k_c).sum(-1))
        scores.diagonal(0, 2, 4).add_(within.movedim(2, -1))  # [B, H, i, j, a]
        values = v_c.flatten(2, 3)
        reads = (queries * blocks_before[..., None, :].exp()).flatten(2, 3)  # [B, H, L, N]
        outputs.append(reads @ state + scores.flatten(2, 3).flatten(-2) @ values)
        ends = (keys * blocks_after[..., None, :].exp()).flatten(2, 3)
        state = total.exp()[..., None] * state + ends.transpose(-1, -2) @ values
    out = torch.stack(outputs, dim=1).transpose(2, 3).reshape(batch, -1, heads, size)
    return out[:, :tokens], state


class TimeMix(nn.Module):
    """RWKV-6's time mix of one block, under the Hugging Face port's names."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden, extra = args.hidden_size, args.time_mix_extra_dim
        self.heads, self.head_size = args.num_heads, args.head_size
        for name in ("x", *MIXES):
            setattr(self, f"time_maa_{name}", nn.Parameter(torch.empty(1, 1, hidden)))
        self.time_maa_w1 = nn.Parameter(torch.empty(hidden, len(MIXES) * extra))
        self.time_maa_w2 = nn.Parameter(torch.empty(len(MIXES), extra, hidden))
        self.time_decay = nn.Parameter(torch.empty(1, 1, hidden))
        self.time_decay_w1 = nn.Parameter(torch.empty(hidden, args.time_decay_extra_dim))
        self.time_decay_w2 = nn.Parameter(torch.empty(args.time_decay_extra_dim, hidden))
        self.time_faaaa = nn.Parameter(torch.empty(self.heads, self.head_size))
        self.receptance = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.value = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, hidden, bias=False)
        self.output = nn.Linear(hidden, hidden, bias=False)
        self.ln_x = nn.GroupNorm(self.heads, hidden, eps=GROUP_NORM_EPS)

    def forward(
        self, x: torch.Tensor, previous: torch.Tensor, state: torch.Tensor, frame: Frame
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] with the token before it `previous` [B, hidden] and the heads'
        state [B, H, N, N] -> (output, the state after the rows' real tokens)."""
        batch, tokens, hidden = x.shape
        delta = shifted(x, previous) - x
        lora = torch.tanh((x + delta * self.time_maa_x) @ self.time_maa_w1)
        # [B, T, 5 * extra] -> [5, B * T, extra] @ [5, extra, hidden] -> [5, B, T, hidden]
        lora = lora.view(batch * tokens, len(MIXES), -1).transpose(0, 1)
        offsets = torch.bmm(lora, self.time_maa_w2).view(len(MIXES), batch, tokens, hidden)
        xw, xk, xv, xr, xg = (
            x + delta * (getattr(self, f"time_maa_{name}") + offset)
            for name, offset in zip(MIXES, offsets, strict=True)
        )
        heads = (batch, tokens, self.heads, self.head_size)
        r, k, v = (
            p(t).float().view(heads)
            for p, t in ((self.receptance, xr), (self.key, xk), (self.value, xv))
        )
        g = F.silu(self.gate(xg))
        log_w = self.time_decay + torch.tanh(xw @ self.time_decay_w1) @ self.time_decay_w2
        log_decay = -torch.exp(log_w.float()).view(heads)
        if frame.counts is not None and bool((frame.counts < tokens).any()):
            # A row's padding leaves its state as it is: no decay, nothing added.
            mask = torch.arange(tokens, device=x.device)[None] < frame.counts.to(x.device)[:, None]
            log_decay = torch.where(mask[..., None, None], log_decay, 0.0)
            k = k * mask[..., None, None]
        recurrence = wkv6_token if tokens == 1 else wkv6_chunked
        out, state = recurrence(state, r, log_decay, k, v, self.time_faaaa.float())
        norm = self.ln_x  # in float32, as the recurrence's outputs are
        out = F.group_norm(
            out.reshape(batch * tokens, hidden), self.heads, norm.weight.float(),
            norm.bias.float(), norm.eps,
        ).view(batch, tokens, hidden)  # fmt: skip
        return self.output((out * g.float()).to(x.dtype)), state


class ChannelMix(nn.Module):
    """sigmoid(receptance(x_r)) * value(relu(key(x_k))^2)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.time_maa_k = nn.Parameter(torch.empty(1, 1, hidden))
        self.time_maa_r = nn.Parameter(torch.empty(1, 1, hidden))
        self.key = nn.Linear(hidden, args.intermediate_size, bias=False)
        self.receptance = nn.Linear(hidden, hidden, bias=False)
        self.value = nn.Linear(args.intermediate_size, hidden, bias=False)

    def forward(self, x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        delta = shifted(x, previous) - x
        xk, xr = x + delta * self.time_maa_k, x + delta * self.time_maa_r
        return torch.sigmoid(self.receptance(xr)) * self.value(torch.relu(self.key(xk)).square())


class Block(nn.Module):
    """x + time_mix(ln1(x)), then + channel_mix(ln2(x)); the first block normalizes its
    input first (pre_ln); every rescale_every blocks, the result halved."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        eps, hidden = args.layer_norm_epsilon, args.hidden_size
        if layer == 0:
            self.pre_ln = nn.LayerNorm(hidden, eps=eps)
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attention = TimeMix(args)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.feed_forward = ChannelMix(args)
        every = args.rescale_every
        self.halves = every > 0 and (layer + 1) % every == 0

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        if hasattr(self, "pre_ln"):
            x = self.pre_ln(x)
        mixes = (self.ln1, self.attention, self.ln2, self.feed_forward)
        x = run_block(x, frame, cache, self.layer, *mixes)
        return x / 2 if self.halves else x


class Body(nn.Module):
    """The embedding, the blocks and the final norm (ln_out)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.ln_out = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)

    @property
    def embed_tokens(self) -> nn.Module:
        """The embedding, under the name CausalLM and the loader read."""
        return self.embeddings

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.ln_out


class Model(StateOnly, CausalLM):
    """model -> lm_head; the KV cache holds no layers, only each block's state."""

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
