"""SeamlessM4T's (v2's and v1's) speech translation to text (llmrun.models.seamless_m4t_v2), as
transformers' SeamlessM4TProcessor prepares a clip and SeamlessM4Tv2ForSpeechToText.generate
decodes it, and the target-language code its text translation starts the decoder with.

Features as SeamlessM4TFeatureExtractor computes them: Kaldi's log-mel filterbank (80 bins,
llmrun.speech_to_text.log_mel), each bin's mean taken off and divided by
sqrt(var (ddof 1) + 1e-7), a zero frame added to an odd count (pad_to_multiple_of 2), and each
two frames stacked into one of 160; the frames its attention mask keeps are the pairs whose
second frame is real. The decoder starts with decoder_start_token_id and the target
language's code (generation_config.json's text_decoder_lang_to_code_id, as generate's tgt_lang
sets decoder_input_ids) and decodes greedily or by the beams the folder or a request asks for
(llmrun.seq2seq); the text is decoded without special tokens.

The text comes in the language asked for: the target language's (CLI --target-language),
else, to transcribe, the language spoken (--language, serve's transcription `language`), or
English for a translation (task "translate", serve's /v1/audio/translations).

Reference: transformers/models/seamless_m4t/feature_extraction_seamless_m4t.py,
models/seamless_m4t_v2/modeling_seamless_m4t_v2.py (SeamlessM4Tv2ForSpeechToText.generate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrun import audio, seq2seq, speech_to_text
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading.vision import feature_extractor
from llmrun.omniasr_clips import ISO_639_1
from llmrun.tokenizer import Tokenizer
from llmrun.translation import SHOWN, Framing
from llmrun.whisper import Transcription

FAMILY = "SeamlessM4T"
MODEL_TYPES = ("seamless_m4t_v2", "seamless_m4t")
EXTRACTOR = "SeamlessM4TFeatureExtractor"
STRIDE = 2
TRANSLATION_TARGET = "eng"  # what /v1/audio/translations translates into
DEFAULT_SOURCE = "eng"  # SeamlessM4TTokenizer's src_lang
CODES = "text_decoder_lang_to_code_id"


def features(samples: np.ndarray, mel_bins: int = 80) -> tuple[torch.Tensor, int]:
    """A clip's stacked frames [frames, STRIDE * mel_bins] (float32) and how many of them
    are real (the attention mask's ones)."""
    mel = speech_to_text.log_mel(samples, mel_bins, FAMILY)
    if len(mel) < STRIDE:
        raise UsageError(f"{len(samples)} samples: shorter than {FAMILY}'s two 10 ms frames")
    mel = (mel - mel.mean(0, keepdims=True)) / np.sqrt(mel.var(0, ddof=1, keepdims=True) + 1e-7)
    frames = len(mel)
    if frames % STRIDE:
        mel = np.concatenate([mel, np.zeros((1, mel_bins), dtype=mel.dtype)])
    stacked = mel.reshape(len(mel) // STRIDE, STRIDE * mel_bins)
    return torch.from_numpy(np.ascontiguousarray(stacked)), frames // STRIDE


def extractor_settings(folder: Path) -> int:
    """The folder's SeamlessM4TFeatureExtractor's num_mel_bins, its settings checked
    against what `features` computes."""
    file, values = feature_extractor(folder)
    kind = values.get("feature_extractor_type", EXTRACTOR)
    if kind != EXTRACTOR:
        raise UnsupportedError(f"{file}: feature_extractor_type {kind!r}, not {EXTRACTOR}")
    fixed = dict(sampling_rate=audio.SAMPLE_RATE, stride=STRIDE, padding_value=0.0)
    odd = [f"{k} {values[k]!r}" for k, v in fixed.items() if values.get(k, v) != v]
    if odd:
        raise UnsupportedError(f"{file}: {', '.join(odd)} (llmrun computes {fixed})")
    bins = values.get("num_mel_bins", 80)
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 2:
        raise ModelFormatError(f"{file}: num_mel_bins {bins!r}")
    return bins


def target_code(generation: dict[str, Any], name: str) -> int:
    """The decoder's code of target language `name` (fra, or __fra__), from
    generation_config.json's text_decoder_lang_to_code_id, as generate's tgt_lang; an ISO
    639-1 code (fr) is taken as the three-letter code OmniASR's table gives it, where the
    folder has that code."""
    codes = generation.get(CODES)
    if not isinstance(codes, dict) or not codes:
        raise ModelFormatError(
            f"{FAMILY}'s generation_config.json has no {CODES}, which names its target languages"
        )
    code = codes.get(language_name(generation, name))
    if isinstance(code, bool) or not isinstance(code, int) or code < 0:
        known = sorted(codes)
        more = f", ... ({len(known)} in all)" if len(known) > SHOWN else ""
        raise UsageError(
            f"unknown target language {name!r} for {FAMILY}: its codes are "
            f"{', '.join(known[:SHOWN])}{more}"
        )
    return code


def language_name(generation: dict[str, Any], name: str) -> str:
    """The folder's name of language `name`: itself without __, or the three-letter code of
    an ISO 639-1 one (fr: fra) where the folder's text_decoder_lang_to_code_id has it."""
    bare = name.replace("__", "")
    mapped = ISO_639_1.get(bare.lower(), "").split("_")[0]
    codes = generation.get(CODES)
    known = codes if isinstance(codes, dict) else {}
    return mapped if bare not in known and mapped in known else bare


def framing(tokenizer: Tokenizer) -> Framing:
    """How SeamlessM4TTokenizer frames a source text: its language's code before it and </s>
    after it (src_lang's default, eng, where none is given), whatever template the saved
    tokenizer.json holds (save_pretrained may keep the target side's, </s> and the code
    first)."""
    frame = Framing.of(tokenizer)
    code = frame.codes.get(f"__{DEFAULT_SOURCE}__", frame.code)
    if code is None or tokenizer.eos_id is None:
        raise ModelFormatError(f"{FAMILY}'s tokenizer has no __{DEFAULT_SOURCE}__ code or </s>")
    return Framing((code,), (tokenizer.eos_id,), frame.codes)


class _Decoder:
    """The model's text decoder as llmrun.seq2seq drives one: cross_cache, new_cache(batch),
    decode(ids, cache, start, cross)."""

    def __init__(self, model: Any) -> None:
        self.model, self.args = model, model.args
        norm = model.model.decoder.layer_norm.weight  # float where the linears are blocks
        self.device, self.dtype = norm.device, norm.dtype

    def cross_cache(self, encoded: torch.Tensor) -> Any:
        return self.model.cross_cache(encoded)

    def new_cache(self, batch: int = 1) -> Any:
        return self.model.new_cache(
            batch, self.args.max_position_embeddings, self.dtype, self.device
        )

    def decode(self, ids: torch.Tensor, cache: Any, start: int, cross: Any) -> torch.Tensor:
        b, t = ids.shape
        positions = torch.arange(start, start + t, device=ids.device).expand(b, t)
        return self.model.decode(ids, positions, cache, cross, False)


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
    target_language: str | None = None,
) -> Transcription:
    """A clip's text by a SeamlessM4T v2 `model` loaded from `folder`: in `target_language`,
    else the `language` spoken (task transcribe), else English (task translate)."""
    if task not in (None, "transcribe", "translate"):
        raise UsageError(f"{FAMILY} transcribes or translates; it does not {task}")
    if prompt:
        raise UsageError(f"{FAMILY} takes no prompt before the audio")
    target = target_language
    if target is None:
        target = TRANSLATION_TARGET if task == "translate" else language
    if target is None:
        raise UsageError(
            f"{FAMILY} writes the language it is told: give the language spoken to transcribe "
            "it (--language), or the language to translate into (--target-language)"
        )
    code = target_code(generation, target)
    settings = seq2seq.Settings.of(generation, config, FAMILY, num_beams)
    if settings.start is None:
        raise ModelFormatError(f"{folder}: no decoder_start_token_id")
    mel_bins = extractor_settings(folder)
    width = model.speech_args.feature_projection_input_dim
    if STRIDE * mel_bins != width:
        raise ModelFormatError(
            f"{folder}: the feature extractor's {STRIDE} x {mel_bins} mel bins, and the model "
            f"takes {width}"
        )
    x, valid = features(clip.samples, mel_bins)
    decoder = _Decoder(model)
    prompt_tokens = settings.prompt([code])
    with torch.inference_mode():
        encoded = model.encode_speech(x[None].to(decoder.device, decoder.dtype), valid)
        ids = seq2seq.generate(decoder, encoded, prompt_tokens, settings)
    text = tokenizer.decode(prompt_tokens + ids, skip_special=True)  # unstripped, as decode
    return Transcription(text, ids, language_name(generation, target), len(prompt_tokens))
