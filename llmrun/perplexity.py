"""Perplexity over a text, measured as llama.cpp's llama-perplexity measures it.

The text is tokenized whole (BOS first where the vocabulary adds one, special-token
text read as plain text) and cut into chunks of n_ctx tokens; the tokens past the last
whole chunk are left out. Each chunk is evaluated on its own from an empty cache, its
first token replaced by BOS where the vocabulary adds one, and only its second half is
scored: the logits at positions n_ctx/2 .. n_ctx-2 against the tokens after them, so
every scored token has at least n_ctx/2 tokens before it. PPL is exp of the mean
negative log-likelihood; its error is that mean's standard error times PPL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmrun.errors import UsageError
from llmrun.models.cache import KVCache
from llmrun.tokenizer import Tokenizer

DEFAULT_CTX = 512  # llama-perplexity's
# Tokens per forward: a chunk of the default context. Past a context, whole chunks go
# together as rows; every position's logits come back, [tokens, vocab] float32 each.
DEFAULT_BATCH = 512
MIN_CTX = 4  # the smallest context that scores a token of each chunk, after two of context

NewCache = Callable[[int, int], KVCache]  # (rows, positions) -> an empty KV cache


@dataclass
class Estimate:
    """The perplexity over the chunks evaluated so far, of `total`."""

    chunks: int
    total: int
    tokens: int  # scored so far
    ppl: float
    error: float | None  # its standard error; None for fewer than two tokens or no spread


def mean_and_error(total: float, squares: float, count: int) -> tuple[float, float | None]:
    """The mean of `count` values from their sum and sum of squares, and its standard
    error (None where it is undefined: fewer than two values, or no spread)."""
    mean = total / count
    variance = squares / count - mean * mean
    if count < 2 or variance <= 0:
        return mean, None
    return mean, math.sqrt(variance / (count - 1))


class Tally:
    """Running sums of negative log-likelihoods, in float64."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.squares = 0.0

    def add(self, nll: torch.Tensor) -> None:
        nll = nll.double()
        self.count += nll.numel()
        self.total += float(nll.sum())
        self.squares += float((nll * nll).sum())

    def ppl(self) -> tuple[float, float | None]:
        """exp of the mean, and its standard error (the mean's, times the derivative)."""
        mean, error = mean_and_error(self.total, self.squares, self.count)
        ppl = math.exp(mean)
        return ppl, None if error is None else error * ppl


def check_ctx(ctx: int) -> None:
    if ctx < MIN_CTX:
        raise UsageError(f"--ctx-size must be at least {MIN_CTX} for perplexity, got {ctx}")


def tokenize(tokenizer: Tokenizer, text: str) -> list[int]:
    """The text's token ids as llama-perplexity takes them: BOS first where the
    vocabulary adds one, special-token text (such as "</s>") read as plain text."""
    return tokenizer.encode(text, parse_special=False)


def chunk(
    tokens: Sequence[int], ctx: int, limit: int | None = None, bos_id: int | None = None
) -> torch.Tensor:
    """Token ids [N, ctx]: the text's whole chunks of `ctx` tokens, at most `limit` of
    them, each one's first token replaced by `bos_id` where given. A text under two
    chunks is refused, as llama-perplexity refuses it."""
    check_ctx(ctx)
    if len(tokens) < 2 * ctx:
        raise UsageError(
            f"the text is {len(tokens)} tokens long; perplexity with a context of {ctx} "
            f"needs at least {2 * ctx} tokens: give a longer text or a smaller --ctx-size"
        )
    if limit is not None and limit < 1:
        raise UsageError(f"--chunks must be positive, got {limit}")
    count = len(tokens) // ctx
    if limit is not None:
        count = min(count, limit)
    chunks = torch.tensor(tokens[: count * ctx], dtype=torch.long).view(count, ctx)
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def text_chunks(
    tokenizer: Tokenizer, text: str, ctx: int, limit: int | None = None
) -> torch.Tensor:
    """The chunks llama-perplexity evaluates of `text` (see chunk)."""
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    return chunk(tokenize(tokenizer, text), ctx, limit, bos)


def scored_targets(chunks: torch.Tensor) -> torch.Tensor:
    """The tokens [N, ctx - 1 - ctx // 2] each chunk's scored logits predict."""
    return chunks[:, chunks.shape[1] // 2 + 1 :]


@torch.inference_mode()
def scored_logprobs(
    model: nn.Module, new_cache: NewCache, chunks: torch.Tensor, batch_size: int = DEFAULT_BATCH
) -> Iterator[torch.Tensor]:
    """Each chunk's float32 log-probabilities [ctx - 1 - ctx // 2, vocab] at its scored
    positions (ctx // 2 .. ctx - 2), on the model's device. `batch_size` tokens go
    through each forward: under a context, a chunk's in pieces through its cache; from
    one, batch_size // ctx chunks together as rows. A chunk's last token predicts
    nothing scored, so it is never fed."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    count, ctx = chunks.shape
    first = ctx // 2
    rows = max(1, batch_size // ctx)
    step = min(batch_size, ctx)
    for start in range(0, count, rows):
        cache = new_cache(min(rows, count - start), ctx)
        ids = chunks[start : start + rows].to(cache.k.device)
        kept = []
        for begin in range(0, ctx - 1, step):
            end = min(begin + step, ctx - 1)
            positions = torch.arange(begin, end, device=ids.device).repeat(ids.shape[0], 1)
            logits = model(ids[:, begin:end], positions, cache)  # [rows, end - begin, vocab]
            if end > first:
                kept.append(torch.log_softmax(logits[:, max(first - begin, 0) :].float(), dim=-1))
        yield from torch.cat(kept, dim=1)


def nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihoods [T] of `targets` [T] under log-probabilities [T, vocab]."""
    return -logprobs.gather(1, targets.to(logprobs.device)[:, None])[:, 0]


def estimates(logprobs: Iterable[torch.Tensor], chunks: torch.Tensor) -> Iterator[Estimate]:
    """The running perplexity after each chunk, from each chunk's scored log-probs."""
    tally = Tally()
    targets = scored_targets(chunks)
    for i, (chunk_logprobs, chunk_targets) in enumerate(zip(logprobs, targets, strict=True)):
        tally.add(nll(chunk_logprobs, chunk_targets))
        yield Estimate(i + 1, len(chunks), tally.count, *tally.ppl())


def measure(
    model: nn.Module,
    new_cache: NewCache,
    chunks: torch.Tensor,
    batch_size: int = DEFAULT_BATCH,
) -> Iterator[Estimate]:
    """The running perplexity of `model` after each of `chunks` (see text_chunks)."""
    return estimates(scored_logprobs(model, new_cache, chunks, batch_size), chunks)
