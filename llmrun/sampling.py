"""Choosing the next token: penalties on the logits, then a sampler.

The chain follows llama.cpp's default order: logit biases, repetition/presence/frequency
penalties, top-k, top-p, min-p, temperature, then a seeded draw.
Temperature 0 is greedy (argmax after penalties). Defaults are llama.cpp's.
With a grammar (structured.py), each Sampler keeps its own place in it and masks the
penalized logits before the draw, so the token drawn is one the grammar allows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from llmrun.errors import UsageError

# Logits sampled to bound the k-th largest from below in `top_k` (any subset's k-th
# largest is at most the whole vector's).
TOP_K_SAMPLE = 4096


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # (token id, value added to its logit) pairs, as OpenAI's logit_bias: -100 bans a token
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A structured.Grammar that decoding follows (compiled once, shared by the sequences).
    grammar: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN too
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"min-p must be in [0, 1], got {self.min_p}")
        if not self.repeat_penalty > 0:
            raise UsageError(
                f"repeat-penalty must be > 0 (1 disables it), got {self.repeat_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise UsageError(
                    f"{name.replace('_', '-')} must be a number, got {getattr(self, name)}"
                )
        if self.repeat_last_n < -1:
            raise UsageError(
                f"repeat-last-n must be >= -1 (-1 means the whole context), got {self.repeat_last_n}"
            )

    def updated(self, **changes: Any) -> SamplingParams:
        """A copy with the given fields changed; None values are ignored."""
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise UsageError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


class Sampler:
    """Draws tokens from float32 logits [V]; seeded so the same seed gives the same text."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed = seed
        # Draws happen on the CPU so a seed means the same text on every device. Its
        # generator keeps 32 bits of a seed: the high 32 of a 64-bit one are mixed in, so
        # seeds that differ only there give different text.
        wide = seed % (1 << 64)
        low, high = wide & 0xFFFFFFFF, wide >> 32
        self.generator = torch.Generator(device="cpu").manual_seed(
            low ^ (high * 0x9E3779B9 & 0xFFFFFFFF)
        )
        self.constraint = params.grammar.constraint() if params.grammar is not None else None
        pairs = params.logit_bias
        self.bias_ids = torch.tensor([i for i, _ in pairs], dtype=torch.long)
        self.bias = torch.tensor([b for _, b in pairs], dtype=torch.float32)

    def biased(self, logits: torch.Tensor) -> torch.Tensor:
        if not len(self.bias):
            return logits
        logits = logits.clone()
        logits[self.bias_ids.to(logits.device)] += self.bias.to(logits.device, logits.dtype)
        return logits

    def penalize(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        p = self.params
        if not history or (
            p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
        ):
            return logits
        last_n = len(history) if p.repeat_last_n == -1 else p.repeat_last_n
        recent = history[-last_n:] if last_n > 0 else []
        if not recent:
            return logits
        ids, counts = torch.tensor(recent, device=logits.device).unique(return_counts=True)
        logits = logits.clone()
        chosen = logits[ids]
        if p.repeat_penalty != 1.0:
            chosen = torch.where(chosen > 0, chosen / p.repeat_penalty, chosen * p.repeat_penalty)
        chosen = chosen - counts.to(chosen.dtype) * p.frequency_penalty - p.presence_penalty
        logits[ids] = chosen
        return logits

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        logits = self.penalize(self.biased(logits), history)
        if self.constraint is None:
            return self.draw(logits)
        token = self.draw(self.constraint.apply(logits))
        self.constraint.accept(token)
        return token

    def draw(self, logits: torch.Tensor) -> int:
        """A token from penalized (and masked) logits: greedy, or top-k/top-p/min-p/temperature."""
        if self.params.temperature == 0:
            return argmax(logits)
        ids, probs = self.candidates(logits)
        if probs is None:
            return int(ids[0])
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(ids[int(choice)])

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ids that top-k, top-p and min-p keep of penalized logits (temperature > 0)
        and their probabilities at the temperature (CPU float32); probabilities None
        where the best logit is out of float range at the temperature (its id alone has
        any probability)."""
        p = self.params
        if p.top_k > 0:
            values, ids = top_k(logits, min(p.top_k, logits.shape[-1]))
        else:
            values, ids = torch.sort(logits, descending=True)
        probs = torch.softmax(values, dim=-1)
        keep = values.shape[-1]
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            cumulative = torch.cumsum(probs, dim=-1)
            keep = min(keep, int((cumulative < p.top_p).sum()) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int((probs >= p.min_p * probs[0]).sum())))
        values, ids = values[:keep], ids[:keep].cpu()
        scaled = values.cpu() / p.temperature
        if not torch.isfinite(scaled[0]):
            # A temperature so small (or a penalty so large) that the best logit is out of
            # float range: no other token has any probability left.
            return ids, None
        return ids, torch.softmax(scaled, dim=-1)

    def distribution(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The probabilities [V] (CPU float64) that __call__ draws the next token from, after
        biases, penalties and the samplers: one-hot at the argmax for greedy. Speculative
        decoding (llmrun.speculative) compares a target's and a draft's."""
        logits = self.penalize(self.biased(logits), history)
        probs = torch.zeros(logits.shape[-1], dtype=torch.float64)
        if self.params.temperature == 0:
            probs[argmax(logits)] = 1.0
            return probs
        ids, kept = self.candidates(logits)
        if kept is None:
            probs[ids[0]] = 1.0
        else:
            probs[ids] = kept.double()
        return probs

    def pick(self, probs: torch.Tensor) -> int:
        """A token drawn from probabilities [V] (not necessarily normalized), seeded."""
        return int(torch.multinomial(probs, 1, generator=self.generator))


def argmax(logits: torch.Tensor) -> int:
    """The id of the largest logit (the first, on ties). On CPU through numpy:
    torch.argmax takes ~0.3 ms on a 150k vocabulary, numpy ~0.01 ms."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits [V], largest first (ties: lower id first), and their ids.

    On CPU, torch.topk takes 0.3-0.5 ms on a 150k vocabulary (k = 40, a 2-core Zen 3).
    Here, the k-th largest of a strided sample bounds the k-th largest from below, so
    only the logits at or above it (~V*k/4096 of them) are partitioned: 0.17-0.3 ms
    there, the same result; finding their ids (np.flatnonzero of the mask) is half of it.
    """
    n = logits.shape[-1]
    sample = logits[:: max(1, n // TOP_K_SAMPLE)]
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or len(sample) < 2 * k:
        return torch.topk(logits, k)
    a, sample = logits.numpy(), sample.numpy()
    bound = np.partition(sample, len(sample) - k)[len(sample) - k]
    candidates = np.flatnonzero(a >= bound)
    if len(candidates) < k:  # NaN logits compare false: let torch order them
        return torch.topk(logits, k)
    kth = np.partition(a[candidates], len(candidates) - k)[len(candidates) - k]
    above = candidates[a[candidates] > kth]
    tied = candidates[a[candidates] == kth]  # in id order: the lowest ids make up k
    best = np.concatenate([above, tied[: k - len(above)]])
    ids = best[np.lexsort((best, -a[best]))]
    return torch.from_numpy(a[ids].copy()), torch.from_numpy(ids)


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token` and the n most likely tokens, from raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if n > 0:
        values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logprobs[token]), top
