"""Maincoder (Maincode/Maincoder-1B): Llama with RoPE on adjacent pairs (x[2i], x[2i+1]) of
the checkpoint's own q/k rows, then an RMSNorm of each query and key head (one scale of
head_dim shared by the heads) after the rotation.

Reference: llama.cpp's src/models/maincoder.cpp and conversion/maincoder.py, which writes
the rows as they are for that pairwise RoPE (the checkpoint's modeling code is remote
code). Parameter names are Llama's with Qwen3's q_norm and k_norm.
"""

from __future__ import annotations

import torch

from llmrun import ops
from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, RMSNorm, rotate_pairs
from llmrun.models.cache import KVCache

ModelArgs = llama.ModelArgs


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = paired_norm(self.q_norm, rotate_pairs(q, frame))
        k = paired_norm(self.k_norm, rotate_pairs(k, frame))
        return self.o_proj(self.attend(q, k, v, frame, cache))


def paired_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` of heads x [B, H, T, D] whose features rotate_pairs left in its order (x0, x2,
    ..., x1, x3, ...): the scale taken in that order too."""
    # [D] -> [D / 2, 2] -> [2, D / 2]
    scale = norm.weight.unflatten(0, (-1, 2)).t().flatten()
    return ops.rms_norm(x, scale, norm.eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
