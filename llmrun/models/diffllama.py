"""DiffLlama (kajuma/DiffLlama-*): Llama with differential attention. Each layer's query
heads come in two halves over the same keys; head h of the first half and head h of the
second attend alike to the value heads of the first KV half and of the second (each
repeated to all KV heads), and their outputs, side by side in 2 * head_dim, are
subtracted, (first - lambda * second), RMS-normed without weights and scaled by
(1 - lambda_init): lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) +
lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 layer).

Reference: transformers/models/diffllama/modular_diffllama.py (the Differential
Transformer, arXiv 2410.05258). llama.cpp has no converter for it: HF folders only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config, attention
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        # The values split into two halves of KV heads; the queries into two of heads.
        if self.num_key_value_heads % 2 or self.num_attention_heads % 2:
            raise ModelFormatError(
                f"DiffLlama: {self.num_attention_heads} query heads and "
                f"{self.num_key_value_heads} KV heads do not split into two halves"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer)
        self.eps = args.rms_norm_eps
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(self.head_dim)))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        k, v = self._all_keys(k, v, frame, cache)
        batch, tokens = q.shape[0], q.shape[2]
        scale = self.head_dim**-0.5
        # [B, Hkv, L, D] -> two [B, Hkv, L, D]: each half's heads repeated to every KV head
        halves = [half.repeat(1, 2, 1, 1) for half in torch.chunk(v, 2, dim=1)]
        out = torch.cat(
            [
                attention(q, k, half, frame.mask, scale).view(batch, tokens, self.n_heads, -1)
                for half in halves
            ],
            dim=-1,
        )  # [B, T, H, 2D]
        first, second = torch.chunk(out, 2, dim=2)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dtype=torch.float32))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dtype=torch.float32))
        lambda_full = (lambda_1 - lambda_2 + self.lambda_init).to(q.dtype)
        out = F.rms_norm(first - lambda_full * second, (out.shape[-1],), eps=self.eps)
        return ((1 - self.lambda_init) * out).reshape(batch, tokens, -1)

    def _all_keys(
        self, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new k/v [B, Hkv, T, D] stored, and every key and value the queries attend
        to (positions 0 .. frame.length - 1; the new ones alone without a cache), in k's
        dtype."""
        if cache is None:
            return k, v
        if cache.paged:
            cache.write(self.layer, k, v, frame.positions)
            return cache.read(self.layer, frame.length, k.dtype)
        if frame.static:
            return cache.update_static(self.layer, k, v, frame.positions, frame.length)
        return cache.update(self.layer, k, v, frame.positions, frame.start, frame.length)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)
