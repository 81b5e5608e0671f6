"""Generation by a text-to-text (encoder-decoder) model, T5's (llmrun.models.t5) or BART's,
mBART's and Marian's (llmrun.models.bart): the prompt through the encoder once, then
llmrun.generate's one loop over the decoder bound to that encoding, from the model's
decoder_start_token_id, sampling as any model samples.

The prompt is the encoder's input as the model's tokenizer frames a sequence (its
tokenizer.json post-processor's, or a GGUF's add_eos: T5's </s> after, BART's <s> before and
</s> after), added where the ids lack it. The decoder keeps its own KV cache per request:
there is no prefix to share between two prompts.

generation_config.json's (else an older folder's config.json's) rules on what the decoder
may choose apply as transformers' logits processors apply them (Rules: bad words of one
token, no repeated n-grams, a minimum length, forced first and last tokens), and its
max_length bounds the decoder where no max_tokens is given (as max_new_tokens overrides it
in transformers).
Beam search (num_beams, length_penalty) is not done: a model whose file asks for it decodes
greedily or by sampling, as llmrun's flags say."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError
from llmrun.generate import KVState, Response, stream_generate
from llmrun.sampling import Sampler
from llmrun.tokenizer import Tokenizer


def encoder_ids(tokenizer: Tokenizer, prompt: Sequence[int]) -> list[int]:
    """`prompt` between the ids the tokenizer puts around a sequence (T5, Marian: </s>
    after; BART: <s> before, </s> after; mBART: the source language's code before), each
    added where the ids lack it."""
    plain = tokenizer.encode("a", add_bos=False)
    whole = tokenizer.encode_sequence("a")
    at = next((i for i in range(len(whole)) if whole[i : i + len(plain)] == plain), len(whole))
    head, tail = whole[:at], whole[at + len(plain) :]
    ids = list(prompt)
    if head and ids[: len(head)] != head:
        ids = head + ids
    if tail and ids[-len(tail) :] != tail:
        ids = ids + tail
    return ids


@dataclass(frozen=True)
class Rules:
    """What generation_config.json says the decoder may choose, as transformers' logits
    processors apply it: never the `banned` ids (NoBadWords, words of one token), no
    n-gram of `no_repeat_ngram` tokens twice (NoRepeatNGram), no end before `min_length`
    decoder tokens (MinLength), `forced_bos` first (ForcedBOS) and `forced_eos` last
    (ForcedEOS), within `max_length` decoder tokens, the start token's included."""

    banned: tuple[int, ...] = ()
    no_repeat_ngram: int = 0
    min_length: int = 0
    forced_bos: int | None = None
    forced_eos: int | None = None
    max_length: int | None = None

    @classmethod
    def of(cls, generation: dict[str, Any], config: dict[str, Any], vocab_size: int) -> Rules:
        """From generation_config.json, else (an older folder without one) config.json, as
        transformers reads them; a bad word of several tokens is refused."""
        merged = generation or config
        bad = merged.get("bad_words_ids") or []
        if not isinstance(bad, list) or not all(
            isinstance(w, list) and all(_is_id(t, vocab_size) for t in w) for w in bad
        ):
            raise ModelFormatError(f"generation_config.json: bad_words_ids {bad!r}")
        if any(len(w) != 1 for w in bad):
            raise UnsupportedError(
                "generation_config.json's bad_words_ids holds a word of several tokens, "
                "which llmrun does not apply"
            )
        forced = {}
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            value = merged.get(name)
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            if value is not None and not _is_id(value, vocab_size):
                raise ModelFormatError(f"generation_config.json: {name} {value!r}")
            forced[name] = value
        counts = {}
        for name in ("no_repeat_ngram_size", "min_length", "max_length"):
            value = merged.get(name)
            if value is not None and not _is_id(value, 1 << 31):
                raise ModelFormatError(f"generation_config.json: {name} {value!r}")
            counts[name] = value
        return cls(
            banned=tuple(w[0] for w in bad),
            no_repeat_ngram=counts["no_repeat_ngram_size"] or 0,
            min_length=counts["min_length"] or 0,
            forced_bos=forced["forced_bos_token_id"],
            forced_eos=forced["forced_eos_token_id"],
            max_length=counts["max_length"] or None,
        )


class Constrained(nn.Module):
    """A decoding whose last logits row follows `rules`, for a decoder that holds `size`
    tokens (the last of which ForcedEOS forces); `eos_ids`: what MinLength holds back."""

    def __init__(
        self, decoding: nn.Module, rules: Rules, size: int, eos_ids: Sequence[int]
    ) -> None:
        super().__init__()
        self.decoding, self.rules, self.size, self.eos_ids = decoding, rules, size, list(eos_ids)
        self.tokens: list[int] = []  # the decoder's tokens so far, the start token first

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any = None, **kw: Any
    ) -> torch.Tensor:
        logits = self.decoding(input_ids, positions, cache, **kw)
        self.tokens += input_ids[0].tolist()
        rules, row = self.rules, logits[0, -1]
        length = int(positions[0, -1]) + 1  # decoder tokens, as transformers' cur_len
        row[list(rules.banned)] = -float("inf")
        n = rules.no_repeat_ngram
        if n and length + 1 >= n:
            tokens, recent = self.tokens[:length], self.tokens[length - n + 1 : length]
            seen = [
                tokens[i + n - 1] for i in range(length - n + 1) if tokens[i : i + n - 1] == recent
            ]
            row[seen] = -float("inf")
        if length < rules.min_length:
            row[self.eos_ids] = -float("inf")
        forced = rules.forced_bos if length == 1 else None
        if length == self.size - 1 and rules.forced_eos is not None:
            forced = rules.forced_eos
        if forced is not None:
            row.fill_(-float("inf"))
            row[forced] = 0.0
        return logits


def _is_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def generate(
    model: Any,
    tokenizer: Tokenizer,
    new_state: Callable[[int], KVState],
    ctx_size: int,
    prompt: Sequence[int],
    sampler: Sampler,
    max_tokens: int | None,
    eos_ids: Sequence[int],
    stop: Sequence[str] = (),
    logprobs: int | None = None,
    rules: Rules | None = None,
) -> Iterator[Response]:
    """Stream the decoder's reply to `prompt` (the encoder's ids); `new_state(size)`: an
    empty decoder KV cache of `size` positions; `ctx_size`: the most tokens the encoder
    takes and the decoder holds; `rules`: generation_config.json's (Rules.of). Stats count
    the encoder's prompt and time."""
    ids = encoder_ids(tokenizer, prompt)
    if len(ids) > ctx_size:
        raise ContextOverflowError(
            f"the prompt is {len(ids)} tokens, but the context holds {ctx_size}; "
            "shorten the prompt or raise --ctx-size"
        )
    device = next(model.parameters()).device
    start = time.perf_counter()
    with torch.inference_mode():
        decoding = model.decoding(model.encode(torch.tensor([ids], device=device)))
    encoded_in = time.perf_counter() - start
    first = [model.args.decoder_start_token_id]
    rules = rules or Rules()
    if max_tokens is not None:  # transformers' max_new_tokens, over max_length
        size = min(1 + max_tokens, ctx_size)
    else:
        size = min(rules.max_length or ctx_size, ctx_size)
        max_tokens = size - 1 if rules.max_length else None
    if rules != Rules():
        decoding = Constrained(decoding, rules, max(size, 2), eos_ids)
    state = new_state(max(size, 2))  # the start token and at least one more
    counted = False
    stream = stream_generate(
        decoding, tokenizer, state, first, sampler, max_tokens, eos_ids, stop, logprobs
    )
    try:
        for response in stream:
            stats = response.stats
            stats.prompt_tokens = stats.prompt_processed = len(ids)
            if not counted and stats.completion_tokens:
                stats.prompt_seconds += encoded_in  # the decoder's first step came after
                counted = True
            yield response
    finally:
        stream.close()
