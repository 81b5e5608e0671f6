"""Sentence embeddings: texts -> token ids -> padded forwards -> pooled, normalized vectors.

A model gives every token's final hidden state (an encoder's `hidden_states(input_ids,
positions, lengths)`; a decoder's through models.base.final_hidden_states, its own forward
up to the final norm); `pool` makes one vector of each text's (mean over
its tokens, its first token's, or its last token's, as llama.cpp's pooling types and
sentence-transformers' Pooling modes do), `project` applies the model's Dense projections
to it, and `normalize` scales it to unit length
(llama.cpp's default --embd-normalize 2; OpenAI's vectors are unit length too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from llmrun.errors import ContextOverflowError, UsageError
from llmrun.loading.embedding import POOLINGS
from llmrun.models.base import final_hidden_states
from llmrun.tokenizer import Tokenizer

DEFAULT_BATCH_SIZE = 32  # texts per forward


@dataclass
class Embedded:
    """Vectors [N, H] (float32, on the CPU) of N inputs, and each input's token count."""

    vectors: torch.Tensor
    tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)


def check_pooling(pooling: str | None, name: str) -> str:
    """The pooling to compute: `pooling` (a --pooling or the file's), refused where the
    model `name` names none, or where it is "none" (a vector per token)."""
    if pooling is None:
        raise UsageError(
            f"{name} names no pooling (it is not an embedding model); choose one: "
            f"--pooling {'|'.join(POOLINGS)}"
        )
    if pooling == "none":
        raise UsageError(
            f"{name}: pooling none gives a vector per token, not one per text; choose "
            f"--pooling {'|'.join(POOLINGS)}"
        )
    if pooling not in POOLINGS:
        raise UsageError(f"unknown pooling {pooling!r} (choose from {', '.join(POOLINGS)})")
    return pooling


def pool(hidden: torch.Tensor, lengths: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector [B, H] per row of hidden [B, T, H], whose rows hold lengths [B] real
    tokens (padded on the right): their mean, the first token's, or the last real one's."""
    if pooling == "mean":
        real = torch.arange(hidden.shape[1], device=hidden.device)[None] < lengths[:, None]
        total = (hidden * real[..., None]).sum(dim=1)
        return total / lengths[:, None].to(hidden.dtype)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    raise UsageError(f"unknown pooling {pooling!r} (choose from {', '.join(POOLINGS)})")


def project(model: nn.Module, pooled: torch.Tensor) -> torch.Tensor:
    """Pooled vectors [B, H] through the model's linear projections after pooling, in
    order (its `projections`: sentence-transformers' Dense modules, EmbeddingGemma's
    2_Dense and 3_Dense), in float32; as they are for a model without any."""
    projections = getattr(model, "projections", ())
    if not projections:
        return pooled
    # The compute dtype: the model's float parameters' (a quantized matrix holds bytes).
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    for projection in projections:
        # [B, H] -> [B, 1, H]: a row of one token, as a quantized matrix takes them.
        pooled = projection(pooled[:, None].to(dtype))[:, 0].float()
    return pooled


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """vectors [N, H] scaled to unit Euclidean length; a zero vector stays zero (as
    llama.cpp's common_embd_normalize leaves it)."""
    norms = torch.linalg.vector_norm(vectors, dim=-1, keepdim=True)
    return torch.where(norms > 0, vectors / norms.clamp_min(torch.finfo(vectors.dtype).tiny), 0.0)


def tokenize(
    tokenizer: Tokenizer, texts: Sequence[str], limit: int, truncate: bool = False
) -> list[list[int]]:
    """Each text's token ids with its special tokens (Tokenizer.encode_sequence), at most
    `limit` of them (the context): a longer text is an error naming both lengths, or with
    `truncate` is cut to fit, keeping a special token that ends it ([SEP], EOS)."""
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode_sequence(text)
        if len(ids) > limit:
            if not truncate:
                raise ContextOverflowError(
                    f"text {i} is {len(ids)} tokens long, more than the context of {limit} "
                    "tokens: shorten it, raise --ctx-size up to the model's length, or cut it "
                    "with --truncate"
                )
            ends = ids[-1] in tokenizer.special_ids
            ids = ids[: limit - 1] + ids[-1:] if ends and limit > 1 else ids[:limit]
        out.append(ids)
    return out


def check_ids(inputs: Sequence[Sequence[int]], vocab_size: int, limit: int) -> None:
    """Token id inputs, each non-empty, in the vocabulary and within `limit` tokens."""
    for i, ids in enumerate(inputs):
        if not ids:
            raise UsageError(f"input {i} is empty: it has no tokens to embed")
        if not all(0 <= t < vocab_size for t in ids):
            raise UsageError(f"input {i}: token ids must be in [0, {vocab_size})")
        if len(ids) > limit:
            raise ContextOverflowError(
                f"input {i} is {len(ids)} tokens long, more than the context of {limit} tokens"
            )


@torch.inference_mode()
def embed_ids(
    model: nn.Module,
    inputs: Sequence[Sequence[int]],
    pooling: str,
    normalized: bool = True,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Float32 vectors [N, H] of N token id sequences: forwards of up to `batch_size` of
    them at once, similar lengths together and padded on the right (a row's vector is the
    same alone or in a batch: the padding never reaches its real tokens), pooled, then
    normalized to unit length where `normalized`."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    # An encoder's own; else the states a decoder's forward hands its head (refused where
    # the forward ends otherwise).
    hidden_states = getattr(model, "hidden_states", None) or partial(final_hidden_states, model)
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    vectors: list[torch.Tensor | None] = [None] * len(inputs)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        lengths = torch.tensor([len(inputs[i]) for i in chosen], device=device)
        width = int(lengths.max())
        ids = torch.zeros(len(chosen), width, dtype=torch.long, device=device)
        for row, i in enumerate(chosen):
            ids[row, : len(inputs[i])] = torch.tensor(inputs[i], device=device)
        positions = torch.arange(width, device=device).expand(len(chosen), width)
        hidden = hidden_states(ids, positions, lengths).float()
        pooled = project(model, pool(hidden, lengths, pooling))
        if normalized:
            pooled = normalize(pooled)
        for row, i in enumerate(chosen):
            vectors[i] = pooled[row]
    if not vectors:
        return torch.zeros(0, 0)
    return torch.stack(vectors).cpu()
