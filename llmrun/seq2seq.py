"""Decoding of a speech encoder-decoder's decoder (Cohere Transcribe's, Moonshine's,
Speech2Text's, Canary's) after a decoder prompt, as transformers' GenerationMixin.generate
decodes it without sampling: greedy, or by beam search (llmrun.beam_search) where
generation_config.json's (or an older config.json's) num_beams asks for it or a request's
overrides it, with its length_penalty and early_stopping. generation_config.json's
decoder_start_token_id (else bos_token_id) put first where the prompt does not begin with
it, suppress_tokens at every step and begin_suppress_tokens at the first (per beam), until
an eos_token_id or max_length decoder tokens (the prompt's included; the prompt's length
plus max_new_tokens where that is given). Where the file gives neither, llmrun decodes up
to the decoder's positions: GenerationConfig's default max_length of 20 would cut a
transcript short. only_transcribes: what the transcribers that neither translate nor take a
prompt refuse.

Reference: transformers/generation/utils.py (_prepare_decoder_input_ids_for_generation,
_prepare_generated_length, _sample, _beam_search), generation/logits_process.py
(SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun import beam_search
from llmrun.beam_search import Beams
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError


@dataclass(frozen=True)
class Settings:
    """The generation_config.json fields decoding reads."""

    start: int | None  # decoder_start_token_id, else bos_token_id
    eos: frozenset[int]
    max_length: int | None
    max_new_tokens: int | None
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    beams: Beams = Beams()  # num_beams 1: greedy

    @classmethod
    def of(
        cls,
        generation: dict[str, Any],
        config: dict[str, Any],
        family: str,
        num_beams: int | None = None,
    ) -> Settings:
        """From generation_config.json, config.json where it lacks a field; a field of the
        wrong kind is a ModelFormatError naming the `family`. Where the folder has no
        generation_config.json, transformers takes the decoding settings an older config.json
        carries (max_length, num_beams, ...: GenerationConfig.from_model_config), and so does
        this. `num_beams`: a request's, over the file's (1: greedy)."""
        source = "generation_config.json" if generation else "config.json"
        if not generation:
            kept = (*_UNREAD, *_LENGTHS, *_BEAMS)
            generation = {k: config[k] for k in kept if k in config}
        merged = {**config, **generation}

        def ids(name: str) -> list[int]:
            value = merged.get(name)
            values = [] if value is None else [value] if isinstance(value, int) else value
            if not isinstance(values, list) or not all(_is_id(v) for v in values):
                raise ModelFormatError(f"{family}'s generation_config.json: {name} {value!r}")
            return values

        changed = [
            f"{name} {generation[name]!r}"
            for name, neutral in _UNREAD.items()
            if generation.get(name) not in (None, neutral)
        ]
        if changed:
            raise UnsupportedError(
                f"{family}'s {source} asks for {', '.join(changed)}, which "
                "llmrun's decoding does not apply"
            )
        start = merged.get("decoder_start_token_id")
        start = merged.get("bos_token_id") if start is None else start
        eos = ids("eos_token_id")
        if not eos:
            raise ModelFormatError(f"{family}'s generation_config.json has no eos_token_id")
        lengths = {name: generation.get(name) for name in _LENGTHS}
        for name, value in lengths.items():
            if value is not None and (not _is_id(value) or value < 1):
                raise ModelFormatError(f"{family}'s generation_config.json: {name} {value!r}")
        if start is not None and not _is_id(start):
            raise ModelFormatError(f"{family}'s config: decoder_start_token_id {start!r}")
        return cls(
            start=start,
            eos=frozenset(eos),
            max_length=lengths["max_length"],
            max_new_tokens=lengths["max_new_tokens"],
            suppress=tuple(ids("suppress_tokens")),
            begin_suppress=tuple(ids("begin_suppress_tokens")),
            beams=Beams.of(generation, {}).requested(num_beams),
        )

    def prompt(self, ids: list[int]) -> list[int]:
        """The decoder prompt generate decodes after: decoder_start_token_id first where
        `ids` do not begin with it."""
        if self.start is not None and (not ids or ids[0] != self.start):
            return [self.start, *ids]
        return ids

    def length(self, prompt: int, positions: int) -> int:
        """The decoder tokens, the prompt's included, decoding stops at."""
        if self.max_new_tokens is not None:
            wanted = prompt + self.max_new_tokens
        else:
            wanted = self.max_length or positions
        if prompt >= min(wanted, positions):
            raise UsageError(
                f"the decoder prompt takes {prompt} tokens, and the model decodes up to "
                f"{min(wanted, positions)} in all"
            )
        return min(wanted, positions)


_LENGTHS = ("max_length", "max_new_tokens")
_BEAMS = ("num_beams", "length_penalty", "early_stopping")
# Fields that would change generate's result, and their neutral values.
_UNREAD = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": 0,
    "bad_words_ids": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "forced_decoder_ids": None,
}


def only_transcribes(task: str | None, prompt: str | None, family: str) -> None:
    """What a transcriber that neither translates nor takes a prompt refuses: a `task`
    other than transcribe, a `prompt`."""
    if task not in (None, "transcribe"):
        raise UsageError(f"{family} transcribes; it does not {task}")
    if prompt:
        raise UsageError(f"{family} takes no prompt before the audio")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def generate(model: Any, encoded: torch.Tensor, prompt: list[int], settings: Settings) -> list[int]:
    """The tokens `model` generates after `prompt` (without the end token) for a clip's
    `encoded` positions [1, positions, width], greedily or by the beam search `settings`
    ask for: its cross-attention keys and values computed once, its self-attention's in a
    cache, up to its max_position_embeddings decoder tokens. `model`: cross_cache(encoded),
    new_cache(batch), decode(ids, cache, start, cross) -> logits, and args.vocab_size and
    args.max_position_embeddings."""
    vocab_size, positions = model.args.vocab_size, model.args.max_position_embeddings
    outside = [t for t in (*prompt, *settings.eos) if t >= vocab_size]
    if outside:
        raise ModelFormatError(f"token id {outside[0]} is outside the vocabulary of {vocab_size}")
    suppress = [t for t in settings.suppress if t < vocab_size]
    begin_suppress = [t for t in settings.begin_suppress if t < vocab_size]
    end = settings.length(len(prompt), positions)
    if settings.beams.num_beams > 1:
        return _beams(model, encoded, prompt, settings, end, suppress, begin_suppress)
    cross, cache = model.cross_cache(encoded), model.new_cache()

    def step(ids: list[int], start: int) -> torch.Tensor:
        tensor = torch.tensor([ids], dtype=torch.long, device=encoded.device)
        return model.decode(tensor, cache, start, cross)[0, -1].float()

    logits = step(prompt, 0)
    out: list[int] = []
    while True:
        if not out:
            logits[begin_suppress] = -float("inf")
        logits[suppress] = -float("inf")
        token = int(logits.argmax())
        if token in settings.eos:
            return out
        out.append(token)
        if len(prompt) + len(out) >= end:
            return out
        logits = step([token], len(prompt) + len(out) - 1)


def _beams(
    model: Any,
    encoded: torch.Tensor,
    prompt: list[int],
    settings: Settings,
    end: int,
    suppress: list[int],
    begin_suppress: list[int],
) -> list[int]:
    """The best hypothesis of the beam search, its beams the rows of one batch that shares
    the encoding's cross-attention keys and values."""
    n = settings.beams.num_beams
    cross = [
        (k.expand(n, *k.shape[1:]), v.expand(n, *v.shape[1:]))
        for k, v in model.cross_cache(encoded)
    ]
    cache = model.new_cache(n)

    def step(tokens: torch.Tensor, start: int) -> torch.Tensor:
        return model.decode(tokens.to(encoded.device), cache, start, cross)[:, -1].float().cpu()

    def process(log_probs: torch.Tensor, sequences: torch.Tensor) -> None:
        if sequences.shape[1] == len(prompt):
            log_probs[:, begin_suppress] = -float("inf")
        log_probs[:, suppress] = -float("inf")

    best = beam_search.search(
        step,
        lambda rows: cache.reorder_rows(rows.to(encoded.device)),
        process,
        prompt,
        settings.beams,
        end,
        sorted(settings.eos),
    )[0].tokens
    return best[:-1] if best and best[-1] in settings.eos else best
