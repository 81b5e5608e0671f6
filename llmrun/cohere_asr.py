"""Cohere Transcribe's speech recognition (llmrun.models.cohere_asr), as transformers'
CohereAsrProcessor prepares a clip and CohereAsrForConditionalGeneration.generate decodes it
(greedily, or by beam search): the clip's features as CohereAsrFeatureExtractor computes
them (its seeded dither, then Parakeet's normalized log-mel:
llmrun.nemotron_omni_clips.features), the decoder prompt get_decoder_prompt_ids makes for
the clip's language (which the model does not detect: it must be given) with punctuation,
decoding by llmrun.seq2seq, and the text decoded without special tokens, as
batch_decode(skip_special_tokens=True).

A clip longer than max_audio_clip_s - overlap_chunk_second (30 s) is split as the feature
extractor splits it (chunks of up to max_audio_clip_s, each ending at the quietest
min_energy_window_samples window of the overlap_chunk_second before its end), each chunk
transcribed alone and the texts joined as the processor's decode joins them.

Reference: transformers/models/cohere_asr/feature_extraction_cohere_asr.py,
processing_cohere_asr.py (get_decoder_prompt_ids, _reassemble_chunk_texts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrun import audio, nemotron_omni_clips, seq2seq
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading.vision import feature_extractor
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription
from llmrun.whisper_languages import CODES

FAMILY = "Cohere Transcribe"
LANGUAGES = ("ar", "de", "el", "en", "es", "fr", "it", "ja", "ko", "nl", "pl", "pt", "vi", "zh")
NO_SPACE = ("ja", "zh")  # chunks' texts joined without a space
EXTRACTOR = "CohereAsrFeatureExtractor"
# What nemotron_omni_clips.features computes: settings the extractor must have.
FIXED = dict(
    sampling_rate=audio.SAMPLE_RATE,
    hop_length=nemotron_omni_clips.HOP,
    n_fft=nemotron_omni_clips.N_FFT,
    win_length=nemotron_omni_clips.WINDOW,
    preemphasis=nemotron_omni_clips.PREEMPHASIS,
)


@dataclass(frozen=True)
class Extractor:
    """CohereAsrFeatureExtractor's settings, its defaults where a file leaves them out."""

    feature_size: int = 128
    dither: float = 1e-5
    max_audio_clip_s: float = 35.0
    overlap_chunk_second: float = 5.0
    min_energy_window_samples: int = 1600

    @classmethod
    def of_folder(cls, path: Path) -> Extractor:
        """From the folder's feature extractor settings (llmrun.loading.vision
        .feature_extractor); the defaults where it has none."""
        file, values = feature_extractor(path)
        kind = values.get("feature_extractor_type", EXTRACTOR)
        if kind != EXTRACTOR:
            raise UnsupportedError(f"{file}: feature_extractor_type {kind!r}, not {EXTRACTOR}")
        odd = [f"{k} {values[k]!r}" for k, v in FIXED.items() if values.get(k, v) != v]
        if odd:
            raise UnsupportedError(f"{file}: {', '.join(odd)} (llmrun computes {FIXED})")
        try:
            extractor = cls(
                feature_size=int(values.get("feature_size", cls.feature_size)),
                dither=float(values.get("dither", cls.dither) or 0.0),
                max_audio_clip_s=float(values.get("max_audio_clip_s", cls.max_audio_clip_s)),
                overlap_chunk_second=float(
                    values.get("overlap_chunk_second", cls.overlap_chunk_second)
                ),
                min_energy_window_samples=int(
                    values.get("min_energy_window_samples", cls.min_energy_window_samples)
                ),
            )
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"{file}: feature extractor settings: {e}") from None
        if extractor.max_audio_clip_s <= 0 or extractor.min_energy_window_samples < 1:
            raise ModelFormatError(f"{file}: max_audio_clip_s or min_energy_window_samples")
        return extractor

    def chunks(self, samples: np.ndarray) -> list[np.ndarray]:
        """The clip as the extractor splits it: whole up to max_audio_clip_s -
        overlap_chunk_second, else chunks ending at energy minima."""
        rate = audio.SAMPLE_RATE
        if len(samples) / rate <= max(0.0, self.max_audio_clip_s - self.overlap_chunk_second):
            return [samples]
        size = max(1, round(self.max_audio_clip_s * rate))
        context = max(1, round(self.overlap_chunk_second * rate))
        waveform = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
        total, start, out = len(samples), 0, []
        while start < total:
            if start + size >= total:
                out.append(samples[start:])
                break
            search = (max(start, start + size - context), min(start + size, total))
            split = self._quietest(waveform, *search) if search[1] > search[0] else start + size
            split = max(start + 1, min(split, total))
            out.append(samples[start:split])
            start = split
        return out

    def _quietest(self, waveform: torch.Tensor, start: int, end: int) -> int:
        """The start of the quietest window (root mean square) in [start, end)."""
        width = self.min_energy_window_samples
        if end - start <= width:
            return (start + end) // 2
        quietest, lowest = start, float("inf")
        for i in range(0, end - start - width, width):
            window = waveform[start + i : start + i + width]
            energy = torch.sqrt(torch.mean(window * window)).item()
            if energy < lowest:
                lowest, quietest = energy, start + i
        return quietest

    def features(self, samples: np.ndarray) -> torch.Tensor:
        """A chunk's features [len // 160 + 1, feature_size], the last frame outside the
        mask: the dither (noise seeded by the chunk's length) added first."""
        if len(samples) < 2 * nemotron_omni_clips.HOP:
            raise UsageError(
                f"{len(samples)} samples of audio (a clip, or a long clip's last chunk): "
                f"under {2 * nemotron_omni_clips.HOP} (20 ms), too short to transcribe"
            )
        x = torch.from_numpy(np.array(samples, dtype=np.float32))
        if self.dither > 0:
            generator = torch.Generator().manual_seed(len(x))
            x += self.dither * torch.randn(len(x), dtype=torch.float32, generator=generator)
        return nemotron_omni_clips.features(x.numpy(), self.feature_size)


def language_code(
    language: str | None, family: str = FAMILY, languages: tuple[str, ...] = LANGUAGES
) -> str:
    """The clip's language as the processor takes it: a code (or an English name) of
    the `family`'s `languages`; none given is an error, as the model does not detect it."""
    if language is None:
        raise UsageError(
            f"{family} does not detect the language: give it (--language, or the request's "
            f"`language`), one of {', '.join(languages)}"
        )
    code = CODES.get(language.lower(), language.lower())
    if code not in languages:
        raise UsageError(f"language {language!r}: {family} transcribes {', '.join(languages)}")
    return code


def token_ids(tokenizer: Tokenizer, pieces: list[str], family: str) -> list[int]:
    """The ids of a decoder prompt's special `pieces`; a piece the tokenizer lacks is a
    ModelFormatError naming the `family`."""
    ids = [tokenizer.token_id(p) for p in pieces]
    missing = [p for p, i in zip(pieces, ids, strict=True) if i is None]
    if missing:
        raise ModelFormatError(f"the tokenizer has no {', '.join(missing)}: not {family}'s")
    return ids


def prompt_ids(tokenizer: Tokenizer, language: str) -> list[int]:
    """The decoder prompt get_decoder_prompt_ids(language, punctuation=True) makes."""
    pieces = [
        "▁",
        "<|startofcontext|>",
        "<|startoftranscript|>",
        "<|emo:undefined|>",
        f"<|{language}|>",
        f"<|{language}|>",
        "<|pnc|>",
        "<|noitn|>",
        "<|notimestamp|>",
        "<|nodiarize|>",
    ]
    return token_ids(tokenizer, pieces, FAMILY)


def transcribe(
    model: Any,
    tokenizer: Tokenizer,
    folder: Path,
    generation: dict[str, Any],
    config: dict[str, Any],
    clip: audio.Clip,
    language: str | None = None,
    task: str | None = None,
    prompt: str | None = None,
    num_beams: int | None = None,
) -> Transcription:
    """A clip's transcript by a Cohere Transcribe `model` loaded from `folder`."""
    seq2seq.only_transcribes(task, prompt, FAMILY)
    code = language_code(language)
    settings = seq2seq.Settings.of(generation, config, FAMILY, num_beams)
    extractor = Extractor.of_folder(folder)
    if extractor.feature_size != model.args.encoder.num_mel_bins:
        raise ModelFormatError(
            f"{folder}: the feature extractor's feature_size {extractor.feature_size}, "
            f"and the encoder takes {model.args.encoder.num_mel_bins} mel bins"
        )
    prompt_tokens = settings.prompt(prompt_ids(tokenizer, code))
    norm = model.model.decoder.norm.weight
    texts, generated = [], []
    with torch.inference_mode():
        for chunk in extractor.chunks(clip.samples):
            features = extractor.features(chunk)
            encoded = model.encode(features.to(norm.device, norm.dtype), features.shape[0] - 1)
            ids = seq2seq.generate(model, encoded, prompt_tokens, settings)
            generated += ids
            texts.append(tokenizer.decode(prompt_tokens + ids, skip_special=True))
    if len(texts) == 1:
        text = texts[0]
    else:
        kept = [t for t in texts if t and t.strip()]
        parts = [kept[0].rstrip(), *(t.strip() for t in kept[1:])] if kept else []
        text = ("" if code in NO_SPACE else " ").join(parts)
    return Transcription(text, generated, code, len(prompt_tokens) * len(texts))
