"""The one generation loop: prefill, sample, detokenize, stop. Used by run, chat,
bench and serve.

generate_step yields (token, raw logits) forever; stream_generate turns that
into text pieces through a TokenStream, stopping on EOS ids, stop strings, max
tokens or a full context, and keeps timings. The batching scheduler (serve)
drives many TokenStreams from one batched forward.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmrun import heap, static_decode
from llmrun.errors import ContextOverflowError, UsageError
from llmrun.models.cache import KVCache
from llmrun.sampling import Sampler, top_logprobs

if TYPE_CHECKING:
    from llmrun.multimodal import PromptImages
    from llmrun.speculative import Speculator

PREFILL_CHUNK = 512
_CHUNKS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
# A hybrid model's state cannot go back, so a prompt keeps a copy of it where the next
# turn's prompt will still agree: at the end of the conversation so far (before the
# generation prompt, which a chat template may not write back with the answer: Qwen3's
# `<think>\n\n</think>\n\n` without thinking) where the caller knows it, else this many
# tokens before the prompt's end, as llama.cpp's server keeps one.
CHECKPOINT_MARGIN = 4


@dataclass
class KVState:
    """A KV cache and the tokens whose keys and values it holds, in order."""

    cache: KVCache
    tokens: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.cache.max_seq_len


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_processed: int = 0  # prompt tokens actually prefilled (the rest came from the cache)
    completion_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    drafted: int = 0  # tokens drafted by speculative decoding (llmrun.speculative)
    accepted: int = 0  # of those, the ones the model accepted

    @property
    def acceptance(self) -> float | None:
        """The share of drafted tokens accepted; None without drafts."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def prompt_tps(self) -> float:
        return self.prompt_processed / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        # The first token comes out of the prefill; the rest each cost one decode step.
        steps = self.completion_tokens - 1
        return steps / self.generation_seconds if steps > 0 and self.generation_seconds else 0.0


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]
    offset: int = 0  # where the token's text begins in the generated text


@dataclass
class Response:
    """One step of stream_generate: the newly printable text, and at the end a finish reason."""

    text: str
    token: int | None
    stats: Stats
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    # The tokens whose text begins in what has been emitted so far and was not yet reported
    # (with logprobs asked for): a token held back with its text comes with it, one cut
    # off with a stop string never.
    logprobs: tuple[TokenLogprob, ...] = ()
    # A prompt's logprobs, when asked for (the batching scheduler sends them once, after
    # the prefill): one per prompt token, None for the first, which nothing predicts.
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def prefill_chunk(model: nn.Module, device: torch.device) -> int:
    """Prompt tokens per forward: PREFILL_CHUNK, on the CPU halved (to 64 at least)
    while the widest activation of a chunk (the widest linear layer's outputs but the
    output head's, float32) would pass glibc's largest heap block (heap.MMAP_THRESHOLD):
    a larger one is mapped anew and faulted in at every layer of every chunk (3.1-3.5 M
    page faults for a 512-token prompt of Qwen2.5-7B's shape). Qwen2.5-7B's 18,944-wide
    feed-forward: 256 tokens; Llama 3 8B's 14,336: 512."""
    if device.type != "cpu":
        return PREFILL_CHUNK
    if model in _CHUNKS:
        return _CHUNKS[model]
    widest = max(
        (
            module.out_features
            for name, module in model.named_modules()
            if isinstance(getattr(module, "out_features", None), int)
            and name.rpartition(".")[2] not in ("lm_head", "output")
        ),
        default=0,
    )
    chunk = PREFILL_CHUNK
    while chunk > 64 and chunk * widest * 4 > heap.MMAP_THRESHOLD:
        chunk //= 2
    _CHUNKS[model] = chunk
    return chunk


@torch.inference_mode()
def prefill(
    model: nn.Module,
    state: KVState,
    tokens: Sequence[int],
    chunk: int | None = None,
    keep_at: int | None = None,
    images: PromptImages | None = None,
) -> torch.Tensor:
    """Feed `tokens` after what the cache already holds, `chunk` at a time (None:
    prefill_chunk's); return the last logits [V]. `keep_at`: a position (counted from
    the sequence's start) after which a hybrid model's recurrent state is kept too
    (llmrun.models.recurrent), for a next prompt that agrees with this one only up to
    there. `images`: the prompt's images (indexes counted from the sequence's start),
    each fed whole in one chunk. The prompt ends where `tokens` do (KVCache.prompt_ends,
    for a model with a reference window)."""
    device = state.cache.k.device
    chunk = chunk or prefill_chunk(model, device)
    offset = len(state.tokens)
    if state.cache.reference_window is not None:
        state.cache.prompt_ends = torch.tensor([offset + len(tokens)], device=device)
    cuts = list(range(0, len(tokens), chunk))
    if images is not None:
        cuts = images.cuts(cuts, offset)
    mark = -1 if keep_at is None else keep_at - len(state.tokens)
    checkpoint = state.cache.recurrent is not None and 0 < mark < len(tokens)
    if checkpoint:
        cuts = sorted({*cuts, mark})
    logits = None
    for begin, end in zip(cuts, [*cuts[1:], len(tokens)], strict=True):
        part = list(tokens[begin:end])
        start = len(state.tokens)
        ids = torch.tensor([part], device=device)
        positions = torch.arange(start, start + len(part), device=device)[None]
        extra = {}
        if images is not None:
            soft = images.tokens(offset + begin, offset + end, device)
            extra = {} if soft is None else {"images": soft}
        logits = model(ids, positions, state.cache, last_only=True, **extra)
        state.tokens.extend(part)
        if checkpoint and end == mark and state.cache.recurrent is not None:
            state.cache.recurrent.checkpoint()
    if logits is None:
        raise ValueError("prefill needs at least one token")
    return logits[0, -1]


def decode(model: nn.Module, state: KVState, token: int) -> torch.Tensor:
    """Feed one token after the cached ones; its logits [V]. On CUDA through the
    static step that CUDA graphs replay (llmrun.static_decode) where it applies."""
    device, position = state.cache.k.device, len(state.tokens)
    ids, positions = (
        torch.tensor([[token]], device=device),
        torch.tensor([[position]], device=device),
    )
    step = static_decode.decoder(model, state.cache)
    if step is not None:
        logits = step(ids, positions, static_decode.bucket(position, state.capacity))
    else:
        logits = model(ids, positions, state.cache)
    state.tokens.append(token)
    return logits[0, -1]


def reuse_prefix(state: KVState, prompt: Sequence[int]) -> int:
    """Drop cached tokens past the prefix shared with `prompt` and return how many
    are kept (at most len(prompt) - 1, so there is always a token to feed)."""
    n = 0
    limit = min(len(state.tokens), len(prompt) - 1)
    while n < limit and state.tokens[n] == prompt[n]:
        n += 1
    # A cache that keeps only the sliding window may have overwritten what n needs.
    n = state.cache.reusable(n)
    del state.tokens[n:]
    return n


@torch.inference_mode()
def generate_step(
    model: nn.Module,
    state: KVState,
    tokens: Sequence[int],
    sampler: Sampler,
    history: list[int],
    keep_at: int | None = None,
    images: PromptImages | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Prefill `tokens` after the cached ones, then yield (token, the raw logits it
    was drawn from) until the caller stops or the context is full. `history`
    (for penalties) grows with each token; `keep_at` and `images`: see prefill."""
    logits = prefill(model, state, tokens, keep_at=keep_at, images=images)
    while True:
        token = sampler(logits, history)
        yield token, logits
        history.append(token)
        if len(state.tokens) >= state.capacity:
            return
        logits = decode(model, state, token)


def check_fits(prompt_tokens: int, capacity: int) -> None:
    if prompt_tokens >= capacity:
        raise ContextOverflowError(
            f"the prompt is {prompt_tokens} tokens, but the context holds {capacity}; "
            f"shorten the prompt or raise --ctx-size"
        )


class TokenStream:
    """One sequence's tokens -> text: detokenizes incrementally, holds back what
    may begin a stop string, keeps timings and decides when generation ends (EOS
    id, stop string, max tokens). stream_generate and the batching scheduler
    each feed it the tokens they sample."""

    def __init__(
        self,
        tokenizer,
        prompt: Sequence[int],
        stats: Stats,
        max_tokens: int | None = None,
        eos_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        logprobs: int | None = None,
    ) -> None:
        self.stats = stats
        self.max_tokens = max_tokens
        self.eos = set(eos_ids)
        self.stop = [s for s in stop if s]
        self.logprobs = logprobs
        # Decoding continues from the prompt, so a leading space or a split character survives.
        self.decoder = tokenizer.stream(after=prompt)
        self.pending = ""
        self.emitted = 0  # characters of text emitted so far
        self.held: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet
        self.finish = "length"
        self.stopped = False
        self.done = False
        self.start = self.first_token_at = time.perf_counter()

    def add(self, token: int, logits: torch.Tensor) -> Response | None:
        """Take the next sampled token (drawn from `logits`): its Response, or None
        for an end-of-generation id. Sets `done` once generation should end."""
        now = time.perf_counter()
        stats = self.stats
        if stats.completion_tokens == 0:
            self.first_token_at = now
            stats.prompt_seconds = now - self.start
        else:
            stats.generation_seconds = now - self.first_token_at
        stats.completion_tokens += 1
        if token in self.eos:
            self.finish, self.done = "stop", True
            return None
        if self.logprobs is not None:
            value, top = top_logprobs(logits, token, self.logprobs)
            self.held.append(TokenLogprob(token, value, top, self.emitted + len(self.pending)))
        text, self.pending, self.stopped = _split_stop(
            self.pending + self.decoder.add(token), self.stop
        )
        if self.stopped:
            self.finish = "stop"
        limit = self.max_tokens is not None and stats.completion_tokens >= self.max_tokens
        self.done = self.stopped or limit
        return Response(text, token, stats, logprobs=self._release(text))

    def _release(self, text: str, final: bool = False) -> tuple[TokenLogprob, ...]:
        """Count `text` as emitted: the held logprobs of tokens that begin in it (at the
        end, all but those cut off with a stop string)."""
        self.emitted += len(text)
        out = [lp for lp in self.held if lp.offset < self.emitted or (final and not self.stopped)]
        self.held = [] if final or self.stopped else self.held[len(out) :]
        return tuple(out)

    def close(self) -> Response:
        """The last Response: the text held back so far and the finish reason."""
        tail = ""
        if not self.stopped:
            tail, _, stopped = _split_stop(
                self.pending + self.decoder.flush(), self.stop, final=True
            )
            if stopped:
                self.finish, self.stopped = "stop", True
        logprobs = self._release(tail, final=True)
        return Response(tail, None, self.stats, finish_reason=self.finish, logprobs=logprobs)


def stream_generate(
    model: nn.Module,
    tokenizer,
    state: KVState,
    prompt: Sequence[int],
    sampler: Sampler,
    max_tokens: int | None,
    eos_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    logprobs: int | None = None,
    history_end: int | None = None,
    speculator: Speculator | None = None,
    images: PromptImages | None = None,
) -> Iterator[Response]:
    """Generate after `prompt`, yielding text as it becomes printable; with a
    `speculator`, by speculative decoding (llmrun.speculative).

    The cache keeps the prefix it shares with `prompt`, so only new tokens are
    prefilled. The streamed texts concatenate to the decoded completion, cut
    before a stop string; text that might begin a stop string is held back until
    it cannot. `images`: the prompt's images (llmrun.multimodal), prefilled in place of
    their placeholder tokens; the cache is reused only up to the first.
    """
    check_fits(len(prompt), state.capacity)
    device = state.cache.k.device
    kept = reuse_prefix(state, prompt if images is None else prompt[: images.first + 1])
    stats = Stats(prompt_tokens=len(prompt), prompt_processed=len(prompt) - kept)
    if max_tokens is not None and max_tokens <= 0:
        yield Response("", None, stats, finish_reason="length")
        return
    out = TokenStream(tokenizer, prompt, stats, max_tokens, eos_ids, stop, logprobs)
    # A hybrid model keeps its state where the next prompt will still agree (see
    # CHECKPOINT_MARGIN): `history_end`, the conversation's end before the generation
    # prompt, where the caller knows it.
    keep_at = history_end if history_end is not None else len(prompt) - CHECKPOINT_MARGIN
    if speculator is None:
        steps = generate_step(model, state, prompt[kept:], sampler, list(prompt), keep_at, images)
    elif images is not None:
        raise UsageError("speculative decoding does not take images")
    else:
        history = list(prompt)
        steps = speculator.generate_step(model, state, prompt[kept:], sampler, history, stats)
    try:
        for token, logits in steps:
            if stats.completion_tokens == 0:
                _sync(device)
            response = out.add(token, logits)
            if response is not None:
                yield response
            if out.done:
                break
    finally:
        steps.close()
    yield out.close()


def _split_stop(pending: str, stop: Sequence[str], final: bool = False) -> tuple[str, str, bool]:
    """(text safe to emit, text to hold back, whether a stop string was found)."""
    cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
    if cut >= 0:
        return pending[:cut], "", True
    if final:
        return pending, "", False
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(pending)), hold, -1):
            if pending.endswith(s[:n]):
                hold = n
                break
    return pending[: len(pending) - hold], pending[len(pending) - hold :], False
