"""Whisper's speech recognition, decoded as transformers' WhisperForConditionalGeneration
.generate decodes a clip greedily, or by beam search (llmrun.beam_search) where
generation_config.json's num_beams or a request's asks for it (then, where asked for, again
at higher temperatures: the fallback below), every rule below applied to each beam's
log-probabilities: the forced decoder prompt (<|startoftranscript|>, the language, the task,
<|notimestamps|>, after <|startofprev|> and the prompt's tokens where a prompt is given), the
language detected from the first step's logits over the language tokens where none is
given, generation_config.json's suppress_tokens at every step and begin_suppress_tokens at
the first, until an end-of-text token or max_length; the text decoded without special tokens
or timestamps, as batch_decode(skip_special_tokens=True).

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

Asked for `timestamps` (OpenAI's verbose_json, srt and vtt), a clip of up to 30 seconds is
decoded with them too, and the transcript comes with its segments: each window's kept tokens
split at every pair of timestamps, with their start and end times, as generate's
return_segments gives them (_retrieve_segment), and each window's scores as openai-whisper's
transcribe reports them with its segments (temperature 0; avg_logprob: the chosen tokens'
log-probabilities after the decoding rules, end-of-text's included, summed and divided by the
number of tokens plus one; compression_ratio: the window's text, UTF-8, over its zlib
compression; no_speech_prob: the <|nospeech|> (or <|nocaptions|>) token's probability in the
logits at <|startoftranscript|>).

Asked for `words`, the transcript comes with its words and their times too (and each token's
time), by llmrun.whisper_words from the cross-attention weights of generation_config.json's
alignment_heads, as transformers' return_token_timestamps and its pipeline's
return_timestamps="word" give them.

With a temperature `fallback` (openai-whisper's transcribe, generate's temperature list with
its thresholds), each window is decoded at the first temperature (0: greedy or the beam
search), and again at each next one (sampled, at that temperature) while its result fails:
its text compresses over compression_ratio_threshold (openai-whisper's ratio of the text),
or its average log-probability (of the chosen tokens, end-of-text's included, as generate's
_retrieve_avg_logprobs averages them, whatever the temperature) is under logprob_threshold;
the last try is kept. A window that fails the log-probability test while its no-speech
probability is over no_speech_threshold is silence: no retry, and it is skipped (no tokens,
`seek` moved by the whole window), as generate's _need_fallback decides.

Reference: transformers/models/whisper/generation_whisper.py (generate,
_retrieve_init_tokens, detect_language, _retrieve_logit_processors, _retrieve_segment,
_set_max_new_tokens_and_length), generation/logits_process.py
(WhisperTimeStampLogitsProcessor), tokenization_whisper.py (get_prompt_ids, decode);
generate_with_fallback and _need_fallback for the fallback; openai-whisper's
whisper/decoding.py (DecodingResult), transcribe.py (decode_with_fallback) and utils.py
(compression_ratio).
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from llmrun import audio, beam_search, whisper_words
from llmrun.beam_search import Beams
from llmrun.errors import ModelFormatError, UsageError
from llmrun.tokenizer import Tokenizer
from llmrun.whisper_languages import CODES, LANGUAGES
from llmrun.whisper_words import Word

TASKS = ("transcribe", "translate")
WINDOW_SAMPLES = 30 * audio.SAMPLE_RATE
# Mel frames a window's features take, and per encoder position (the second convolution's
# stride): a timestamp's 20 ms is 2 frames.
WINDOW_FRAMES, FRAMES_PER_POSITION = WINDOW_SAMPLES // audio.HOP_LENGTH, 2
# Seconds per timestamp step, and per mel frame (generate's time_precision and
# time_precision_features).
TIME_PRECISION, FRAME_SECONDS = 0.02, 0.01
# GenerationConfig's max_length where generation_config.json gives none.
DEFAULT_MAX_LENGTH = 20
# What WhisperTokenizer.decode removes from the text (timestamp tokens).
TIMESTAMP = re.compile(r"<\|(\d+\.\d+)\|>")


@dataclass(frozen=True)
class Segment:
    """A stretch of a transcript between two timestamps, with its window's scores, as
    OpenAI's verbose_json segments hold it."""

    id: int
    seek: int  # the first mel frame (10 ms) of the window it was decoded in
    start: float  # seconds from the clip's start
    end: float
    text: str
    tokens: list[int]  # its timestamp tokens included
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None  # None: the model has no <|nospeech|> token


@dataclass(frozen=True)
class Transcription:
    text: str
    ids: list[int]  # the tokens generated, every window's, without end-of-text
    # The language's code: given, detected, "en" for an English-only Whisper; None: unknown.
    language: str | None
    prompt_tokens: int  # the decoder prompt's tokens, every window's
    # With their times, where asked for and the family predicts them; else None.
    segments: tuple[Segment, ...] | None = None
    # Where word timestamps were asked for: the words of the segments, and each of `ids`'s
    # time in seconds (float32, as generate's token_timestamps); else None.
    words: tuple[Word, ...] | None = None
    token_times: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Fallback:
    """A temperature fallback's schedule and thresholds (None: that test is off);
    openai-whisper's transcribe defaults by default."""

    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6

    @classmethod
    def starting_at(cls, temperature: float) -> Fallback:
        """openai-whisper's schedule from `temperature`: up by 0.2 to 1.0 (at most)."""
        if not 0 <= temperature <= 2:
            raise UsageError(f"temperature {temperature}: give a number from 0 to 2")
        steps = max(0, int(round((1.0 - temperature) / 0.2, 6)))
        return cls(tuple(round(temperature + 0.2 * i, 6) for i in range(steps + 1)))

    def verdict(self, window: Window, text: str) -> tuple[bool, bool]:
        """Whether a window's decoding (its `text`) is to be decoded again at the next
        temperature, and whether the window is silence, to be skipped."""
        retry = False
        threshold = self.compression_ratio_threshold
        if threshold is not None and compression_ratio(text) > threshold:
            retry = True
        average = window.logprob / max(window.scored, 1)
        if self.logprob_threshold is not None and average < self.logprob_threshold:
            retry = True
            silence, limit = window.no_speech, self.no_speech_threshold
            if limit is not None and silence is not None and silence > limit:
                return False, True
        return retry, False


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
    beams: Beams = Beams()  # num_beams 1: greedy
    # (decoder layer, head) pairs whose cross-attention times words; () where none is given.
    alignment_heads: tuple[tuple[int, int], ...] = ()
    median_filter_width: int = 7  # config.json's: the word alignment's filter

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
            beams=Beams.of(generation, {}),
            alignment_heads=_pairs(generation.get("alignment_heads")),
            median_filter_width=_filter_width(config.get("median_filter_width", 7)),
        )


def _pairs(values: Any) -> tuple[tuple[int, int], ...]:
    if values is None:
        return ()
    if not isinstance(values, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(_whole(v) for v in pair)
        for pair in values
    ):
        raise ModelFormatError(
            f"Whisper's generation_config.json: alignment_heads {values!r} is not a list of "
            "[layer, head] pairs"
        )
    return tuple((layer, head) for layer, head in values)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _filter_width(value: Any) -> int:
    if not _whole(value) or value % 2 != 1:
        raise ModelFormatError(f"Whisper's config.json: median_filter_width {value!r} is not odd")
    return value


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


class Window(NamedTuple):
    """A window's decoding."""

    tokens: list[int]  # generated, without end-of-text
    logprob: float  # the chosen tokens' log-probabilities (end-of-text's too), summed
    no_speech: float | None  # the no-speech token's probability at <|startoftranscript|>
    temperature: float = 0.0
    ended: bool = True  # by end-of-text (else by max_length)

    @property
    def scored(self) -> int:
        """The tokens whose log-probabilities `logprob` sums."""
        return len(self.tokens) + self.ended


class Decoder:
    """Decoding of one 30-second window by a Whisper model (llmrun.models.whisper): greedy,
    or by the beam search its settings ask for."""

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
        """The logits [len(ids), vocab] after each of `ids`, in the model's dtype."""
        tensor = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model.decode(tensor, cache, start, self.cross)[0]

    def detect_language(self) -> int:
        """The language token whose logit is highest after <|startoftranscript|>."""
        start = [self.settings.decoder_start]
        logits = self._logits(start, self.model.new_cache(1, 1), 0)[-1].float()
        languages = torch.tensor(sorted(self.settings.lang_to_id.values()), device=self.device)
        return int(languages[logits[languages].argmax()])

    def generate(
        self,
        ids: list[int],
        max_length: int,
        timestamps: bool,
        no_speech: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Window:
        """The tokens after the decoder prompt `ids`, up to `max_length` tokens in all;
        `timestamps`: predicted, by the timestamp rules; `no_speech`: the token whose
        probability at <|startoftranscript|> the window reports; `temperature` over 0:
        each token sampled at it (by `generator`), else the likeliest (or the beams')."""
        if self.settings.beams.num_beams > 1 and temperature == 0:
            return self._beams(ids, max_length, timestamps, no_speech)
        cache = self.model.new_cache()
        prompt = self._logits(ids, cache, 0)
        silence = None
        if no_speech is not None:
            at_start = prompt[ids.index(self.settings.decoder_start)].float()
            silence = float(torch.softmax(at_start, dim=-1)[no_speech])
        logits = prompt[-1].float()
        out: list[int] = []
        logprob = 0.0
        while True:
            if not out:
                logits[self.begin_suppress] = -float("inf")
            logits[self.suppress] = -float("inf")
            if timestamps:
                self._timestamp_rules(logits, out)
            if temperature > 0:
                chances = torch.softmax(logits / temperature, dim=-1).cpu()
                token = int(torch.multinomial(chances, 1, generator=generator))
            else:
                token = int(logits.argmax())
            logprob += float(torch.log_softmax(logits, dim=-1)[token])
            if token in self.settings.eos:
                return Window(out, logprob, silence, temperature)
            out.append(token)
            if len(ids) + len(out) >= max_length:
                return Window(out, logprob, silence, temperature, ended=False)
            logits = self._logits([token], cache, len(ids) + len(out) - 1)[-1].float()

    def _beams(
        self, ids: list[int], max_length: int, timestamps: bool, no_speech: int | None
    ) -> Window:
        """The best hypothesis of the beam search (llmrun.beam_search), the rules applied to
        each beam's log-probabilities as generate's logits processors apply them; its
        log-probability the sum its score was divided from."""
        beams = self.settings.beams
        n, silence = beams.num_beams, None
        cache = self.model.new_cache(n)
        cross = [(k.expand(n, *k.shape[1:]), v.expand(n, *v.shape[1:])) for k, v in self.cross]

        def step(tokens: torch.Tensor, start: int) -> torch.Tensor:
            nonlocal silence
            logits = self.model.decode(tokens.to(self.device), cache, start, cross)
            if start == 0 and no_speech is not None:
                at_start = logits[0, ids.index(self.settings.decoder_start)].float()
                silence = float(torch.softmax(at_start, dim=-1)[no_speech])
            return logits[:, -1].float().cpu()

        def process(log_probs: torch.Tensor, sequences: torch.Tensor) -> None:
            for row, tokens in zip(log_probs, sequences.tolist(), strict=True):
                out = tokens[len(ids) :]
                if not out:
                    row[self.begin_suppress] = -float("inf")
                row[self.suppress] = -float("inf")
                if timestamps:
                    self._timestamp_rules(row, out)

        best = beam_search.search(
            step,
            lambda rows: cache.reorder_rows(rows.to(self.device)),
            process,
            ids,
            beams,
            max_length,
            sorted(self.settings.eos),
        )[0]
        logprob = best.score * max(len(best.tokens), 1) ** beams.length_penalty
        tokens = best.tokens
        ended = bool(tokens) and tokens[-1] in self.settings.eos
        if ended:
            tokens = tokens[:-1]
        return Window(tokens, logprob, silence, ended=ended)

    def alignment(self, ids: list[int], window: Window) -> torch.Tensor:
        """The cross-attention weights [alignment heads, tokens, 1500] of the window's
        generated tokens but the last (end-of-text where it ended so), by one pass over
        the prompt `ids` and them, as generate records them step by step."""
        fed = window.tokens if window.ended else window.tokens[:-1]
        weights: list[torch.Tensor] = []
        tensor = torch.tensor([ids + fed], dtype=torch.long, device=self.device)
        heads = self.settings.alignment_heads
        cache = self.model.new_cache(1, len(ids) + len(fed))
        self.model.decode(tensor, cache, 0, self.cross, weights, heads)
        return torch.stack([w[0, len(ids) :] for w in weights]).cpu()

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


class Piece(NamedTuple):
    """A segment of a window: its tokens, and its start and end in timestamp steps (20 ms)
    from the window's start."""

    tokens: list[int]
    start: int
    end: int


def split_window(tokens: list[int], frames: int, first: int) -> tuple[list[Piece], int]:
    """A window's segments as _retrieve_segment splits its tokens, and the frames its `seek`
    moves on. With a pair of timestamps: a segment ends at each pair's first timestamp and
    the next starts at its second; the tokens after the last pair are dropped and `seek`
    moves to its first timestamp, unless the window ends on a lone timestamp (the last
    segment ends there, `seek` moves by the window's `frames`). Without: one segment of
    every token from the window's start to its last timestamp (the window's end where that
    is none or <|0.00|>), `seek` moved by `frames`."""
    stamp = [t >= first for t in tokens]
    pairs = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
    if not pairs:
        stamps = [t for t in tokens if t >= first]
        # generate computes the window's end in float32: int(frames * 0.01 / 0.02).
        ends = np.float32(frames) * np.float32(FRAME_SECONDS) / np.float32(TIME_PRECISION)
        end = stamps[-1] - first if stamps and stamps[-1] != first else int(ends)
        return [Piece(tokens, 0, end)], frames
    single_ending = stamp[-2:] == [False, True]
    cuts = [*pairs, len(tokens)] if single_ending else [*pairs[:-1], pairs[-1] + 1]
    pieces, begin = [], 0
    for cut in cuts:
        piece = tokens[begin:cut]
        # The last segment's end is its pair's first timestamp (its second is kept too).
        last = piece[-2] if cut == cuts[-1] and not single_ending else piece[-1]
        pieces.append(Piece(piece, piece[0] - first, last - first))
        begin = cut
    if single_ending:
        return pieces, frames
    return pieces, (tokens[cuts[-1] - 2] - first) * FRAMES_PER_POSITION


def compression_ratio(text: str) -> float:
    """The text's UTF-8 bytes over their zlib compression (openai-whisper's)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


def transcribe(
    model: Any,
    tokenizer: Tokenizer,
    settings: Settings,
    clip: audio.Clip,
    language: str | None = None,
    task: str | None = None,
    prompt: str | None = None,
    timestamps: bool = False,
    num_beams: int | None = None,
    words: bool = False,
    fallback: Fallback | None = None,
    seed: int | None = None,
) -> Transcription:
    """A clip's transcript (or English translation, with task "translate") by `model`;
    `prompt`: the text before it (generate's prompt_ids); `timestamps`: predicted whatever
    the clip's length, and the transcript's segments given with their times; `num_beams`:
    a beam search's (1: greedy), over the settings'; `words`: the segments' words with their
    times too; `fallback`: a temperature fallback's (None: none), its sampling seeded by
    `seed` (None: a random seed)."""
    settings.check(model.args.vocab_size)
    settings = dataclasses.replace(settings, beams=settings.beams.requested(num_beams))
    if words:
        _check_alignment_heads(settings, model.args)
    timestamps = timestamps or words
    before = prompt_ids(tokenizer, prompt) if prompt else []
    mel = features(clip, model.args.num_mel_bins)
    total = mel.shape[1]
    # The frames of audio (not padding) as the feature extractor's attention mask counts them.
    audio_frames = -(-len(clip.samples) // audio.HOP_LENGTH)
    segments: list[Segment] | None = [] if timestamps else None
    # Long-form predicts them, asked for or not.
    timestamps = timestamps or total > WINDOW_FRAMES or settings.return_timestamps
    if timestamps and settings.timestamp_begin is None:
        raise UsageError(
            f"{clip.name}: Whisper transcribes it with timestamps (a clip over 30 seconds, "
            "return_timestamps or a format with times), and this model's "
            "generation_config.json has no no_timestamps_token_id"
        )
    no_speech = None
    if segments is not None or fallback is not None:
        named = (tokenizer.token_id(t) for t in ("<|nospeech|>", "<|nocaptions|>"))
        no_speech = next((t for t in named if t is not None), None)
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    longest, max_length = model.args.max_target_positions, settings.max_length
    # Where no <|notimestamps|> says it, no token is a timestamp (generate's fallback).
    first = settings.timestamp_begin or model.args.vocab_size + 1
    generated: list[int] = []
    times: list[float] = []
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
            if fallback is None:
                decoded, skip = decoder.generate(ids, max_length, timestamps, no_speech), False
            else:
                decoded, skip = _fall_back(
                    decoder, tokenizer, fallback, generator, ids, max_length, timestamps, no_speech
                )
            if skip:
                seek += frames
                continue
            # Without timestamps too: a timestamp token the model writes moves `seek` (the
            # window is then decoded again from there), as in generate.
            pieces, moved = split_window(decoded.tokens, frames, first)
            kept = [t for piece in pieces for t in piece.tokens]
            generated += kept
            if words:
                weights = decoder.alignment(ids, decoded)
                # A window that starts past the audio's end (after a timestamp written past
                # it) aligns over no frames (transformers crops by a negative count there,
                # which leaves none 15 s or more past the end).
                window_times = whisper_words.token_times(
                    weights, max(audio_frames - seek, 0), settings.median_filter_width
                )
                offset = np.float32(seek * TIME_PRECISION / FRAMES_PER_POSITION)
                times += [float(t + offset) for t in window_times[: len(kept)]]
            if segments is not None:
                segments += window_segments(tokenizer, decoded, pieces, seek, first, len(segments))
            # A pair at <|0.00|> (possible after <|notimestamps|>, where no rule holds)
            # would have generate decode the same window forever: move past it.
            seek += moved or frames
    text = TIMESTAMP.sub("", tokenizer.decode(generated, skip_special=True))
    languages = {v: k.strip("<|>") for k, v in (settings.lang_to_id or {}).items()}
    found = next((languages[t] for t in forced if t in languages), None)
    if found is None and settings.multilingual is False:
        found = "en"  # an English-only model (*.en)
    timed_words = None
    if words:
        timed_words = tuple(_segment_words(tokenizer, segments, times, first, found))
    return Transcription(
        text,
        generated,
        found,
        prompt_tokens,
        None if segments is None else tuple(segments),
        timed_words,
        tuple(times) if words else None,
    )


def _fall_back(
    decoder: Decoder,
    tokenizer: Tokenizer,
    fallback: Fallback,
    generator: torch.Generator,
    ids: list[int],
    max_length: int,
    timestamps: bool,
    no_speech: int | None,
) -> tuple[Window, bool]:
    """A window decoded at each of the fallback's temperatures in turn until a result holds
    (else the last is kept), and whether the window is silence, to be skipped."""
    first = decoder.settings.timestamp_begin or decoder.model.args.vocab_size + 1
    for temperature in fallback.temperatures:
        decoded = decoder.generate(ids, max_length, timestamps, no_speech, temperature, generator)
        text = tokenizer.decode([t for t in decoded.tokens if t < first]).strip()
        retry, skip = fallback.verdict(decoded, text)
        if not retry:
            break
    return decoded, skip


def _check_alignment_heads(settings: Settings, args: Any) -> None:
    """Refuse word timestamps without alignment heads, or with heads the model lacks."""
    if not settings.alignment_heads:
        raise UsageError(
            "word timestamps: this Whisper model's generation_config.json has no "
            "alignment_heads (the cross-attention heads that time words); the Hub's "
            "openai/whisper-* folders have them"
        )
    for layer, head in settings.alignment_heads:
        if layer >= args.decoder_layers or head >= args.decoder_attention_heads:
            raise ModelFormatError(
                f"Whisper's generation_config.json: alignment head [{layer}, {head}] is not "
                f"one of the {args.decoder_layers} decoder layers' {args.decoder_attention_heads} "
                "heads"
            )


def _segment_words(
    tokenizer: Tokenizer,
    segments: list[Segment],
    times: list[float],
    first: int,
    language: str | None,
) -> list[Word]:
    """Each segment's words, a token spanning from the time of the token before it (in the
    whole transcript; 0 for the first) to its own, both to the hundredth of a second, as the
    pipeline times them."""
    out: list[Word] = []
    index = 0
    for segment in segments:
        text, spans = [], []
        for token in segment.tokens:
            if token < first and token not in tokenizer.special_ids:
                start = round(times[index - 1], 2) if index else 0.0
                text.append(token)
                spans.append((start, round(times[index], 2)))
            index += 1
        out += whisper_words.words(tokenizer, text, spans, language)
    return out


def window_segments(
    tokenizer: Tokenizer, window: Window, pieces: list[Piece], seek: int, first: int, count: int
) -> list[Segment]:
    """A window's pieces as segments numbered from `count`, timed from its `seek` as
    generate times them (float64: seek * 0.02 / 2 + position * 0.02), with the window's
    scores."""

    def text(tokens: list[int]) -> str:
        return tokenizer.decode([t for t in tokens if t < first], skip_special=True)

    offset = seek * TIME_PRECISION / FRAMES_PER_POSITION
    avg_logprob = window.logprob / (len(window.tokens) + 1)
    ratio = compression_ratio(text(window.tokens).strip())
    return [
        Segment(
            id=count + i,
            seek=seek,
            start=offset + piece.start * TIME_PRECISION,
            end=offset + piece.end * TIME_PRECISION,
            text=text(piece.tokens),
            tokens=piece.tokens,
            temperature=window.temperature,
            avg_logprob=avg_logprob,
            compression_ratio=ratio,
            no_speech_prob=window.no_speech,
        )
        for i, piece in enumerate(pieces)
    ]
