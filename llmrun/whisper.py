"""Whisper's speech recognition, decoded as transformers' WhisperForConditionalGeneration
.generate decodes a clip greedily (num_beams=1, no temperature fallback): the forced decoder
prompt (<|startoftranscript|>, the language, the task, <|notimestamps|>, after
<|startofprev|> and the prompt's tokens where a prompt is given), the language detected from
the first step's logits over the language tokens where none is given,
generation_config.json's suppress_tokens at every step and begin_suppress_tokens at the
first, until an end-of-text token or max_length; the text decoded without special tokens or
timestamps, as batch_decode(skip_special_tokens=True).

A clip of up to 30 seconds is one window, its audio zero-padded to 30 seconds as
WhisperFeatureExtractor pads it. A longer one is transcribed by generate's long-form
(sequential) algorithm, on the features of the whole clip (the extractor's truncation=False,
padding="longest"), with timestamps predicted (WhisperTimeStampLogitsProcessor's rules; a
short clip too where generation_config.json's return_timestamps asks for them).
Either way, as generate does: a window is decoded from `seek` (its features zero-padded to
3000 frames), its tokens are kept up to its last pair of timestamps, and the next window
starts at that pair's first timestamp (after the window where it ends on a lone timestamp
or has no pair); the prompt goes before every window, no previous text does
(condition_on_prev_tokens off, generate's default).

Reference: transformers/models/whisper/generation_whisper.py (generate,
_retrieve_init_tokens, detect_language, _retrieve_logit_processors, _retrieve_segment,
_set_max_new_tokens_and_length), generation/logits_process.py
(WhisperTimeStampLogitsProcessor), tokenization_whisper.py (get_prompt_ids, decode).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmrun import audio
from llmrun.errors import ModelFormatError, UsageError
from llmrun.tokenizer import Tokenizer
from llmrun.whisper_languages import CODES, LANGUAGES

TASKS = ("transcribe", "translate")
WINDOW_SAMPLES = 30 * audio.SAMPLE_RATE
# Mel frames a window's features take, and per encoder position (the second convolution's
# stride): a timestamp's 20 ms is 2 frames.
WINDOW_FRAMES, FRAMES_PER_POSITION = WINDOW_SAMPLES // audio.HOP_LENGTH, 2
# GenerationConfig's max_length where generation_config.json gives none.
DEFAULT_MAX_LENGTH = 20
# What WhisperTokenizer.decode removes from the text (timestamp tokens).
TIMESTAMP = re.compile(r"<\|(\d+\.\d+)\|>")


@dataclass(frozen=True)
class Transcription:
    text: str
    ids: list[int]  # the tokens generated, every window's, without end-of-text
    language: str | None  # the language's code (given or detected); None: the model has none
    prompt_tokens: int  # the decoder prompt's tokens, every window's


@dataclass(frozen=True)
class Settings:
    """The generation_config.json fields Whisper's generate reads."""

    decoder_start: int
    eos: frozenset[int]
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    lang_to_id: Mapping[str, int] | None
    task_to_id: Mapping[str, int] | None
    multilingual: bool | None
    no_timestamps: int | None
    forced: tuple[int | None, ...]  # forced_decoder_ids' tokens at positions 1, 2, ...
    max_length: int
    max_initial_timestamp: int | None  # max_initial_timestamp_index
    return_timestamps: bool  # timestamps for a clip of up to 30 seconds too

    def check(self, vocab_size: int) -> None:
        """Refuse token ids outside the model's vocabulary (suppressed ones may be: they
        are dropped)."""
        ids = [
            self.decoder_start,
            *self.eos,
            *(self.lang_to_id or {}).values(),
            *(self.task_to_id or {}).values(),
            *(t for t in self.forced if t is not None),
            *([self.no_timestamps] if self.no_timestamps is not None else []),
        ]
        outside = next((i for i in ids if i >= vocab_size), None)
        if outside is not None:
            raise ModelFormatError(
                f"Whisper's generation_config.json: token id {outside} is outside the "
                f"vocabulary of {vocab_size}"
            )

    @property
    def timestamp_begin(self) -> int | None:
        """The first timestamp token, <|0.00|>, right after <|notimestamps|>."""
        return None if self.no_timestamps is None else self.no_timestamps + 1

    @classmethod
    def of(cls, generation: dict[str, Any], config: dict[str, Any]) -> Settings:
        """From generation_config.json (and config.json where it lacks a field); a field of
        the wrong kind is a ModelFormatError."""
        merged = {**config, **generation}
        start = _id(merged.get("decoder_start_token_id"), "decoder_start_token_id")
        eos = merged.get("eos_token_id")
        eos = _ids([eos] if isinstance(eos, int) else eos, "eos_token_id")
        if not eos:
            raise ModelFormatError("Whisper's generation_config.json has no eos_token_id")
        forced = merged.get("forced_decoder_ids") or []
        tokens: list[int | None] = []
        if not isinstance(forced, list) or not all(
            isinstance(pair, list) and len(pair) == 2 for pair in forced
        ):
            raise ModelFormatError(f"forced_decoder_ids {forced!r}: not [index, token] pairs")
        if forced and forced[0][0] == 1:
            for position, (index, token) in enumerate(forced, start=1):
                if index != position:
                    raise ModelFormatError(
                        f"forced_decoder_ids {forced}: not one token for each position from 1"
                    )
                tokens.append(None if token is None else _id(token, "forced_decoder_ids"))
        no_timestamps = generation.get("no_timestamps_token_id")
        initial = generation.get("max_initial_timestamp_index")
        return cls(
            decoder_start=start,
            eos=frozenset(eos),
            suppress=tuple(_ids(merged.get("suppress_tokens"), "suppress_tokens")),
            begin_suppress=tuple(
                _ids(merged.get("begin_suppress_tokens"), "begin_suppress_tokens")
            ),
            lang_to_id=_id_map(generation.get("lang_to_id"), "lang_to_id"),
            task_to_id=_id_map(generation.get("task_to_id"), "task_to_id"),
            multilingual=generation.get("is_multilingual"),
            no_timestamps=None
            if no_timestamps is None
            else _id(no_timestamps, "no_timestamps_token_id"),
            forced=tuple(tokens),
            max_length=_id(generation.get("max_length") or DEFAULT_MAX_LENGTH, "max_length"),
            return_timestamps=generation.get("return_timestamps") is True,
            max_initial_timestamp=None
            if initial is None
            else _id(initial, "max_initial_timestamp_index"),
        )


def _id(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelFormatError(
            f"Whisper's generation_config.json: {name} {value!r} is not a token id"
        )
    return value


def _ids(values: Any, name: str) -> list[int]:
    if values is None:
        return []
    if not isinstance(values, list):
        raise ModelFormatError(f"Whisper's generation_config.json: {name} is not a list")
    return [_id(v, name) for v in values]


def _id_map(values: Any, name: str) -> dict[str, int] | None:
    if values is None:
        return None
    if not isinstance(values, dict):
        raise ModelFormatError(f"Whisper's generation_config.json: {name} is not an object")
    return {str(k): _id(v, name) for k, v in values.items()}


def language_id(settings: Settings, language: str) -> int:
    """The token of a language given as a code ("de"), a name ("german") or a token
    ("<|de|>"), as generate's language_to_id reads it."""
    name = language.lower()
    lang_to_id = settings.lang_to_id or {}
    if name in lang_to_id:
        token = name
    elif name in CODES:
        token = f"<|{CODES[name]}|>"
    elif name in LANGUAGES:
        token = f"<|{name}|>"
    else:
        raise UsageError(
            f"language {language!r}: not one Whisper knows; give an ISO 639-1 code such as "
            "'en' or a name such as 'english'"
        )
    if token not in lang_to_id:
        raise UsageError(f"language {language!r}: this Whisper model has no {token} token")
    return lang_to_id[token]


def forced_prompt(
    settings: Settings,
    language: str | None,
    task: str | None,
    detect: Callable[[], int],
    timestamps: bool = False,
) -> list[int]:
    """The decoder's forced tokens as generate's _retrieve_init_tokens makes them: the
    old forced_decoder_ids only where neither a language nor a task is given, `detect()`
    where the language is still open and the model has language tokens, <|transcribe|>
    after a given language where no task is there, <|notimestamps|> last unless
    `timestamps` are predicted."""
    if settings.multilingual is False and (language is not None or task is not None):
        raise UsageError("an English-only Whisper model takes no language or task")
    if task is not None and task not in TASKS:
        raise UsageError(f"task {task!r}: Whisper's are {' and '.join(TASKS)}")
    tokens: list[int | None] = [settings.decoder_start]
    if language is None and task is None:
        tokens += settings.forced
    lang = None
    if language is not None:
        if settings.lang_to_id is None:
            raise UsageError("this Whisper model's generation_config.json has no languages")
        lang = language_id(settings, language)
    elif settings.lang_to_id is not None and (len(tokens) <= 1 or tokens[1] is None):
        lang = detect()
    if lang is not None:
        if len(tokens) > 1:
            tokens[1] = lang
        else:
            tokens.append(lang)
    task_ids = set((settings.task_to_id or {}).values())
    if task is not None:
        if settings.task_to_id is None or task not in settings.task_to_id:
            raise UsageError(f"this Whisper model's generation_config.json has no task {task!r}")
        chosen = settings.task_to_id[task]
        tokens = [chosen if t in task_ids else t for t in [*tokens, chosen]]
    elif language is not None and settings.task_to_id and not task_ids & set(tokens):
        tokens.append(settings.task_to_id["transcribe"])
    if timestamps and tokens[-1] == settings.no_timestamps:
        tokens.pop()
    elif not timestamps and settings.no_timestamps is not None:
        if tokens[-1] != settings.no_timestamps:
            tokens.append(settings.no_timestamps)
    return [t for t in tokens if t is not None]


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """<|startofprev|> and the text's tokens after a space, as get_prompt_ids makes them."""
    start = tokenizer.token_id("<|startofprev|>")
    if start is None:
        raise UsageError(
            "this Whisper model's tokenizer has no <|startofprev|>: it takes no prompt"
        )
    ids = tokenizer.encode(" " + text.strip(), add_bos=False)
    special = next((i for i in ids if i in tokenizer.special_ids), None)
    if special is not None:
        piece = tokenizer.token_to_piece(special)
        raise UsageError(f"the prompt holds the special token {piece}, which Whisper's may not")
    return [start, *ids]


def features(clip: audio.Clip, mel_bins: int) -> np.ndarray:
    """The clip's log-mel features [mel_bins, frames] as WhisperFeatureExtractor makes them
    for generate: a clip of up to 30 seconds zero-padded to 30 (3000 frames), a longer one
    whole (truncation=False, padding="longest": a frame per 10 ms)."""
    samples = clip.samples
    if len(samples) <= WINDOW_SAMPLES:
        samples = np.pad(samples, (0, WINDOW_SAMPLES - len(samples)))
    return audio.log_mel(samples, mel_bins)


class Decoder:
    """Greedy decoding of one 30-second window by a Whisper model (llmrun.models.whisper)."""

    def __init__(self, model: Any, settings: Settings, window: np.ndarray):
        self.model, self.settings = model, settings
        norm = model.model.decoder.layer_norm.weight
        self.device = norm.device
        x = torch.from_numpy(np.ascontiguousarray(window))[None].to(self.device, norm.dtype)
        self.cross = model.cross_cache(model.encode(x))
        vocab = model.args.vocab_size
        self.suppress = [t for t in settings.suppress if 0 <= t < vocab]
        self.begin_suppress = [t for t in settings.begin_suppress if 0 <= t < vocab]

    def _logits(self, ids: list[int], cache: Any, start: int) -> torch.Tensor:
        tensor = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model.decode(tensor, cache, start, self.cross)[0, -1].float()

    def detect_language(self) -> int:
        """The language token whose logit is highest after <|startoftranscript|>."""
        logits = self._logits([self.settings.decoder_start], self.model.new_cache(1, 1), 0)
        languages = torch.tensor(sorted(self.settings.lang_to_id.values()), device=self.device)
        return int(languages[logits[languages].argmax()])

    def generate(self, ids: list[int], max_length: int, timestamps: bool) -> list[int]:
        """The greedy tokens after the decoder prompt `ids`, up to `max_length` tokens in
        all, without end-of-text; `timestamps`: predicted, by the timestamp rules."""
        cache = self.model.new_cache()
        logits = self._logits(ids, cache, 0)
        out: list[int] = []
        while True:
            if not out:
                logits[self.begin_suppress] = -float("inf")
            logits[self.suppress] = -float("inf")
            if timestamps:
                self._timestamp_rules(logits, out)
            token = int(logits.argmax())
            if token in self.settings.eos:
                return out
            out.append(token)
            if len(ids) + len(out) >= max_length:
                return out
            logits = self._logits([token], cache, len(ids) + len(out) - 1)

    def _timestamp_rules(self, logits: torch.Tensor, out: list[int]) -> None:
        """WhisperTimeStampLogitsProcessor on the logits after the tokens `out`: no
        <|notimestamps|>; timestamps in pairs (after a pair text, after a lone one a
        timestamp or the end) that never go back; a timestamp first (at most
        max_initial_timestamp_index); only timestamps where together they are likelier
        than the likeliest text token."""
        first = self.settings.timestamp_begin
        eos = min(self.settings.eos)
        logits[self.settings.no_timestamps] = -float("inf")
        last = len(out) >= 1 and out[-1] >= first
        penultimate = len(out) < 2 or out[-2] >= first
        if last and penultimate:
            logits[first:] = -float("inf")
        elif last:
            logits[:eos] = -float("inf")
        stamps = [t for t in out if t >= first]
        lowest = first
        if stamps:
            lowest = stamps[-1] if last and not penultimate else stamps[-1] + 1
        logits[first:lowest] = -float("inf")
        if not out:
            logits[:first] = -float("inf")
            if self.settings.max_initial_timestamp is not None:
                logits[first + self.settings.max_initial_timestamp + 1 :] = -float("inf")
        logprobs = torch.log_softmax(logits, dim=-1)
        if logprobs[first:].logsumexp(dim=-1) > logprobs[:first].max():
            logits[:first] = -float("inf")


def kept_tokens(tokens: list[int], frames: int, first: int) -> tuple[list[int], int]:
    """A long-form window's tokens that generate keeps (up to its last pair of timestamps,
    where it has one and does not end on a lone timestamp; else all), and the frames its
    `seek` moves on (to the last pair's first timestamp; else the window's `frames`), as
    _retrieve_segment has them."""
    stamp = [t >= first for t in tokens]
    pairs = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
    if not pairs or stamp[-2:] == [False, True]:
        return tokens, frames
    end = pairs[-1] + 1  # the pair's second timestamp is kept
    return tokens[:end], (tokens[end - 2] - first) * FRAMES_PER_POSITION


def transcribe(
    model: Any,
    tokenizer: Tokenizer,
    settings: Settings,
    clip: audio.Clip,
    language: str | None = None,
    task: str | None = None,
    prompt: str | None = None,
) -> Transcription:
    """A clip's transcript (or English translation, with task "translate") by `model`;
    `prompt`: the text before it (generate's prompt_ids)."""
    settings.check(model.args.vocab_size)
    before = prompt_ids(tokenizer, prompt) if prompt else []
    mel = features(clip, model.args.num_mel_bins)
    total = mel.shape[1]
    timestamps = total > WINDOW_FRAMES or settings.return_timestamps  # long-form needs them
    if timestamps and settings.timestamp_begin is None:
        raise UsageError(
            f"{clip.name}: Whisper transcribes it with timestamps (a clip over 30 seconds, or "
            "return_timestamps), and this model's generation_config.json has no "
            "no_timestamps_token_id"
        )
    longest, max_length = model.args.max_target_positions, settings.max_length
    # Where no <|notimestamps|> says it, no token is a timestamp (generate's fallback).
    first = settings.timestamp_begin or model.args.vocab_size + 1
    generated: list[int] = []
    forced: list[int] = []
    prompt_tokens = seek = 0
    with torch.inference_mode():
        while seek < total:
            frames = min(total - seek, WINDOW_FRAMES)
            window = np.zeros((mel.shape[0], WINDOW_FRAMES), dtype=np.float32)
            window[:, :frames] = mel[:, seek : seek + frames]
            decoder = Decoder(model, settings, window)
            if not forced:
                forced = forced_prompt(
                    settings, language, task, decoder.detect_language, timestamps
                )
            ids = before + forced
            # generate's max_length, raised by each window's prompt (up to half the positions).
            max_length = min(max_length + min(longest // 2 - 1, len(ids)), longest)
            if len(ids) >= max_length:
                raise UsageError(
                    f"the decoder prompt takes {len(ids)} tokens, and this Whisper model "
                    f"generates up to {max_length} in all: shorten the prompt"
                )
            prompt_tokens += len(ids)
            # Without timestamps too: a timestamp token the model writes moves `seek` (the
            # window is then decoded again from there), as in generate.
            kept, moved = kept_tokens(decoder.generate(ids, max_length, timestamps), frames, first)
            generated += kept
            # A pair at <|0.00|> (possible after <|notimestamps|>, where no rule holds)
            # would have generate decode the same window forever: move past it.
            seek += moved or frames
    text = TIMESTAMP.sub("", tokenizer.decode(generated, skip_special=True))
    languages = {v: k.strip("<|>") for k, v in (settings.lang_to_id or {}).items()}
    found = next((languages[t] for t in forced if t in languages), None)
    return Transcription(text, generated, found, prompt_tokens)
