"""Generation by a text-to-text (encoder-decoder) model, T5's (llmrun.models.t5) or BART's,
mBART's and Marian's (llmrun.models.bart): the prompt through the encoder once, then
llmrun.generate's one loop over the decoder bound to that encoding, from the model's
decoder_start_token_id, sampling as any model samples.

The prompt is the encoder's input as the model's tokenizer frames a sequence (its
tokenizer.json post-processor's, or a GGUF's add_eos: T5's </s> after, BART's <s> before and
</s> after), added where the ids lack it; an image-to-text model's prompt comes framed by its
processor (multimodal.PromptImages.framed: Florence-2's image before <s>, TrOCR's image
alone) and is taken as it is. The decoder keeps its own KV cache per request:
there is no prefix to share between two prompts.

generation_config.json's (else an older folder's config.json's) rules on what the decoder
may choose apply as transformers' logits processors apply them (Rules: bad words of one
token, no repeated n-grams, a minimum length, forced first and last tokens), and its
max_length bounds the decoder where no max_tokens is given (as max_new_tokens overrides it
in transformers), and so does its max_new_tokens (SeamlessM4T's), over max_length.

Decoding is transformers' default for these models: deterministic (do_sample false), by
beam search where generation_config.json's num_beams asks for it (llmrun.beam_search, its
length_penalty and early_stopping), else greedy; a request's num_beams overrides the file's
(1: the generation loop's greedy or sampled decoding), and sampling (a temperature above 0)
decodes one beam, as transformers samples. Beams cannot stream: their text comes when the
search ends. A many-to-many translator's source and target languages (llmrun.translation)
replace the code the tokenizer frames the prompt with and generation_config.json's
forced_bos_token_id; a multilingual Marian's, its >>xxx<< token before the prompt;
SeamlessM4T's, its source's code before the prompt (llmrun.seamless_m4t.framing) and its
target's code after the decoder's start token, as its generate's tgt_lang puts it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun import beam_search, seamless_m4t
from llmrun.beam_search import MAX_BEAMS, Beams
from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError, UsageError
from llmrun.generate import KVState, Response, Stats, TokenStream, stream_generate
from llmrun.models.cache import KVCache
from llmrun.multimodal import PromptImages
from llmrun.sampling import Sampler, SamplingParams
from llmrun.tokenizer import Tokenizer
from llmrun.translation import Framing, marian_codes, marian_target


@dataclass(frozen=True)
class Rules:
    """What generation_config.json says the decoder may choose, as transformers' logits
    processors apply it: never the `banned` ids (NoBadWords, words of one token), no
    n-gram of `no_repeat_ngram` tokens twice (NoRepeatNGram), none of `encoder_no_repeat_ngram`
    tokens that is in the `source` (the encoder's ids: EncoderNoRepeatNGram), no end before
    `min_length` decoder tokens (MinLength), `forced_bos` first (ForcedBOS) and `forced_eos`
    last (ForcedEOS), within `max_length` decoder tokens, the start token's included, or
    `max_new_tokens` after the decoder's prompt."""

    banned: tuple[int, ...] = ()
    no_repeat_ngram: int = 0
    encoder_no_repeat_ngram: int = 0
    source: tuple[int, ...] = ()  # a request's (Rules.of gives none)
    min_length: int = 0
    forced_bos: int | None = None
    forced_eos: int | None = None
    max_length: int | None = None
    max_new_tokens: int | None = None

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
        for name in (
            "no_repeat_ngram_size",
            "encoder_no_repeat_ngram_size",
            "min_length",
            "max_length",
            "max_new_tokens",
        ):
            value = merged.get(name)
            if value is not None and not _is_id(value, 1 << 31):
                raise ModelFormatError(f"generation_config.json: {name} {value!r}")
            counts[name] = value
        return cls(
            banned=tuple(w[0] for w in bad),
            no_repeat_ngram=counts["no_repeat_ngram_size"] or 0,
            encoder_no_repeat_ngram=counts["encoder_no_repeat_ngram_size"] or 0,
            min_length=counts["min_length"] or 0,
            forced_bos=forced["forced_bos_token_id"],
            forced_eos=forced["forced_eos_token_id"],
            max_length=counts["max_length"] or None,
            max_new_tokens=counts["max_new_tokens"] or None,
        )

    def apply(
        self, row: torch.Tensor, tokens: Sequence[int], size: int, eos_ids: Sequence[int]
    ) -> None:
        """The rules, in place, on the scores `row` [vocab] of the token after `tokens`
        (the decoder's so far, the start token first) of a decoder that holds `size`."""
        length = len(tokens)  # transformers' cur_len
        row[list(self.banned)] = -float("inf")
        n = self.no_repeat_ngram
        if n and length + 1 >= n:
            recent = list(tokens[length - n + 1 :])
            seen = [
                tokens[i + n - 1]
                for i in range(length - n + 1)
                if list(tokens[i : i + n - 1]) == recent
            ]
            row[seen] = -float("inf")
        n = self.encoder_no_repeat_ngram
        if n and length + 1 >= n:  # the source's n-grams that the last n - 1 tokens begin
            recent = list(tokens[length - n + 1 :])
            source = self.source
            seen = [
                source[i + n - 1]
                for i in range(len(source) - n + 1)
                if list(source[i : i + n - 1]) == recent
            ]
            row[seen] = -float("inf")
        if length < self.min_length:
            row[list(eos_ids)] = -float("inf")
        forced = self.forced_bos if length == 1 else None
        if length == size - 1 and self.forced_eos is not None:
            forced = self.forced_eos
        if forced is not None:
            row.fill_(-float("inf"))
            row[forced] = 0.0


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
        length = int(positions[0, -1]) + 1  # decoder tokens, as transformers' cur_len
        self.rules.apply(logits[0, -1], self.tokens[:length], self.size, self.eos_ids)
        return logits


def _is_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


@dataclass(frozen=True)
class Options:
    """What a request asks of a text-to-text decoding besides its sampling: `num_beams`
    (None: generation_config.json's where decoding is greedy, else 1), a many-to-many
    translator's source and target languages (codes, llmrun.translation), and which of a
    beam search's finished hypotheses, best first, is the reply (`hypothesis`: serve's n
    choices, as transformers' num_return_sequences; None: every one's reply in turn, each
    ending with its final response, from the one search)."""

    num_beams: int | None = None
    source_language: str | None = None
    target_language: str | None = None
    hypothesis: int | None = 0


@dataclass(frozen=True)
class Plan:
    """How a request decodes: the rules (its target language forced first), the beams (1:
    the generation loop's decoding; more: each beam's tokens penalized by
    `repetition_penalty` as transformers' RepetitionPenaltyLogitsProcessor does), the
    tokenizer's frame with the source's code, a multilingual Marian's target token, and
    SeamlessM4T's decoder prefix."""

    rules: Rules
    beams: Beams
    frame: Framing
    source: int | None = None
    repetition_penalty: float = 1.0
    # Which finished hypothesis, best first, the reply is (beams only; None: every one's).
    hypothesis: int | None = 0
    marian_target: int | None = None  # a multilingual Marian's >>xxx<< token, put first
    # The decoder's tokens after its start token: SeamlessM4T's target-language code, as
    # its generate's tgt_lang sets decoder_input_ids.
    prefix: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        generation: dict[str, Any],
        config: dict[str, Any],
        tokenizer: Tokenizer,
        name: str,
        params: SamplingParams,
        logprobs: int | None = None,
        options: Options | None = None,
    ) -> Plan:
        """The Plan of a request for model `name` (generation_config.json, config.json, its
        tokenizer) that samples with `params`; what beams cannot do with it is refused."""
        options = options or Options()
        rules = Rules.of(generation, config, tokenizer.vocab_size)
        beams = Beams.of(generation, config)
        greedy = params.temperature == 0
        n = options.num_beams
        if n is None:
            n = beams.num_beams if greedy else 1
        elif not 1 <= n <= MAX_BEAMS:
            raise UsageError(f"the number of beams must be between 1 and {MAX_BEAMS}, got {n}")
        if n > 1:
            if not greedy:
                raise UsageError(
                    f"beam search ({n} beams) does not sample: it goes with temperature 0 "
                    "(beam sampling is not done); ask for 1 beam to sample"
                )
            refused = {
                "logprobs": logprobs is not None,
                "a grammar or response format": params.grammar is not None,
                "logit_bias": bool(params.logit_bias),
                "presence and frequency penalties": (
                    params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                ),
            }
            for what, asked in refused.items():
                if asked:
                    raise UsageError(f"{what}: not with beam search ({n} beams); ask for 1 beam")
        seamless = config.get("model_type") in seamless_m4t.MODEL_TYPES
        frame = seamless_m4t.framing(tokenizer) if seamless else Framing.of(tokenizer)
        source = None
        if options.source_language is not None:
            source = frame.code_id(options.source_language, name, "source")
            if frame.code is None:
                raise UsageError(
                    f"{name}'s tokenizer puts no language code around a text, so it takes no "
                    "source language"
                )
        marian, prefix = None, ()
        if seamless:
            if options.target_language is None:
                raise UsageError(
                    f"{name} translates into the language it is told: give a target language "
                    "(--target-language, target_language)"
                )
            prefix = (seamless_m4t.target_code(generation, options.target_language),)
        elif options.target_language is not None and config.get("model_type") == "marian":
            marian = marian_target(tokenizer, options.target_language, name)
        elif options.target_language is not None:
            target = frame.code_id(options.target_language, name, "target")
            if config.get("model_type") == "mbart" and frame.code in frame.tail:
                raise UsageError(
                    f"{name} frames a text as MBartTokenizer does (its language code after it): "
                    "its target language is its decoder_start_token_id, not a forced first token"
                )
            rules = dataclasses.replace(rules, forced_bos=target)
        beams = dataclasses.replace(beams, num_beams=n)
        hypothesis = options.hypothesis if n > 1 else 0
        if hypothesis is not None and hypothesis >= n:
            raise UsageError(
                f"reply {hypothesis + 1} of a beam search: it finishes {n} hypotheses ({n} beams)"
            )
        penalty = params.repeat_penalty if n > 1 else 1.0
        return cls(rules, beams, frame, source, penalty, hypothesis, marian, prefix)


def generate(
    model: Any,
    tokenizer: Tokenizer,
    new_cache: Callable[[int, int], KVCache],
    ctx_size: int,
    prompt: Sequence[int],
    sampler: Sampler,
    max_tokens: int | None,
    eos_ids: Sequence[int],
    stop: Sequence[str] = (),
    logprobs: int | None = None,
    plan: Plan | None = None,
    images: PromptImages | None = None,
) -> Iterator[Response]:
    """Stream the decoder's reply to `prompt` (the encoder's ids); `new_cache(rows,
    size)`: an empty decoder KV cache of `rows` sequences of `size` positions; `ctx_size`:
    the most tokens the encoder takes and the decoder holds; `plan`: the request's
    (Plan.of; None: no rules, one beam); `images`: the prompt's (T5Gemma 2's encoder takes
    them). Beams yield their text when the search ends. Stats count the encoder's prompt
    and time."""
    plan = plan or Plan(Rules(), Beams(), Framing.of(tokenizer))
    if images is not None and images.framed:
        ids = list(prompt)
    else:
        ids = plan.frame.ids(list(prompt), plan.source)
    if plan.marian_target is not None:  # in place of a code the prompt begins with
        if ids and ids[0] in marian_codes(tokenizer).values():
            ids = ids[1:]
        ids = [plan.marian_target, *ids]
    if len(ids) > ctx_size:
        raise ContextOverflowError(
            f"the prompt is {len(ids)} tokens, but the context holds {ctx_size}; "
            "shorten the prompt or raise --ctx-size"
        )
    device = next(model.parameters()).device
    start = time.perf_counter()
    with torch.inference_mode():
        tensor = torch.tensor([ids], device=device)
        if images is None:
            encoded = model.encode(tensor)
        else:  # where the framing put tokens before the prompt, its images moved along
            at = next(i for i in range(len(ids)) if ids[i : i + len(prompt)] == list(prompt))
            placed = PromptImages(images.embeds, [s + at for s in images.starts])
            encoded = model.encode(tensor, placed)
    encoded_in = time.perf_counter() - start
    first = [model.args.decoder_start_token_id, *plan.prefix]
    if plan.rules.encoder_no_repeat_ngram:
        plan = dataclasses.replace(plan, rules=dataclasses.replace(plan.rules, source=tuple(ids)))
    rules = plan.rules
    if max_tokens is None:
        max_tokens = rules.max_new_tokens
    if max_tokens is not None:  # transformers' max_new_tokens, over max_length
        size = min(len(first) + max_tokens, ctx_size)
    else:
        size = min(rules.max_length or ctx_size, ctx_size)
        max_tokens = size - len(first) if rules.max_length else None
    size = max(size, len(first) + 1)  # the start token(s) and at least one more
    if plan.beams.num_beams > 1:
        yield from _beam_responses(
            model, tokenizer, new_cache, encoded, ids, first, size, plan, eos_ids, stop,
            max_tokens, encoded_in,
        )  # fmt: skip
        return
    with torch.inference_mode():
        decoding = model.decoding(encoded)
    if rules != Rules():
        decoding = Constrained(decoding, rules, size, eos_ids)
    state = KVState(new_cache(1, size))
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


def _beam_responses(
    model: Any,
    tokenizer: Tokenizer,
    new_cache: Callable[[int, int], KVCache],
    encoded: torch.Tensor,
    ids: list[int],
    first: list[int],
    size: int,
    plan: Plan,
    eos_ids: Sequence[int],
    stop: Sequence[str],
    max_tokens: int | None,
    encoded_in: float,
) -> Iterator[Response]:
    """The text and stats of plan.hypothesis's finished hypothesis (None: of each, best
    first, one reply after another), as the generation loop reports a reply."""
    n, device = plan.beams.num_beams, encoded.device
    if max_tokens is not None and max_tokens <= 0:
        for _ in range(n if plan.hypothesis is None else 1):
            stats = Stats(prompt_tokens=len(ids), prompt_processed=len(ids))
            yield Response("", None, stats, finish_reason="length")
        return
    cache = new_cache(n, size)
    times = [time.perf_counter()]
    with torch.inference_mode():
        decoding = model.decoding(encoded.expand(n, -1, -1))

        def step(tokens: torch.Tensor, position: int) -> torch.Tensor:
            count = tokens.shape[1]  # the decoder prompt at first, then a token a step
            positions = torch.arange(position, position + count, device=device).expand(n, count)
            logits = decoding(tokens.to(device), positions, cache, last_only=True)
            times.append(time.perf_counter())
            return logits[:, -1].float().cpu()

        def process(log_probs: torch.Tensor, sequences: torch.Tensor) -> None:
            penalty = plan.repetition_penalty
            for row, tokens in zip(log_probs, sequences.tolist(), strict=True):
                if penalty != 1.0:  # every token of the beam's, the start token's too
                    seen = row[tokens]
                    row[tokens] = torch.where(seen < 0, seen * penalty, seen / penalty)
                plan.rules.apply(row, tokens, size, eos_ids)

        hypotheses = beam_search.search(
            step,
            lambda rows: cache.reorder_rows(rows.to(device)),
            process,
            first,
            plan.beams,
            size,
            eos_ids,
        )
    if plan.hypothesis is not None:
        hypotheses = [hypotheses[plan.hypothesis]]
    replies = []
    for hypothesis in hypotheses:
        stats = Stats(prompt_tokens=len(ids), prompt_processed=len(ids))
        out = TokenStream(tokenizer, first, stats, max_tokens, eos_ids, stop)
        for token in hypothesis.tokens:
            response = out.add(token, None)
            if response is not None:
                replies.append(response)
            if out.done:
                break
        replies.append(out.close())
        stats.prompt_seconds = encoded_in + times[1] - times[0]  # the encoder and first step
        stats.generation_seconds = times[-1] - times[1]
    yield from replies
