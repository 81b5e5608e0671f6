"""Prompts with audio, for Qwen3-ASR: Qwen3-Omni's (llmrun.qwen3_omni_clips: each
<|audio_pad|> place expanded for its clip, the clip's features over the clip itself, its
chunks and windows) with Qwen3ASRFeatureExtractor's two differences: a clip under half a
second is zero-padded to half a second first, its padding counted as audio, and the
features' last chunk is zero-padded to a whole chunk (1 second) before the convolutions,
however short the clip. A prompt's positions run on as text's (the M-RoPE of a GGUF's
qwen3vl text turns them as plain RoPE).

A transcription's prompt is Qwen3ASRProcessor.apply_transcription_request's: a system turn
of a context where one is given, a user turn of the one clip, then an assistant turn
begun, which a given language fills with "language NAME<asr_text>" (the model then writes
the transcription alone; otherwise it names the language it hears first). Its answer is
read as Qwen3ASRProcessor.parse_output reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from llmrun import audio, qwen3_omni_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.qwen3_asr import Qwen3ASRAudio
from llmrun.models import qwen3_omni_audio
from llmrun.qwen2_vl_images import QwenPromptImages
from llmrun.tokenizer import Tokenizer

AUDIO_PAD = qwen3_omni_clips.AUDIO_PAD
# How a message's audio part is written: the chat template of llama.cpp's text GGUF reads
# a message's content as text.
AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"
ASR_TEXT = "<asr_text>"
MIN_SAMPLES = 8000  # Qwen3ASRFeatureExtractor's min_length
# The names the model was trained with in the forced-language suffix (the processor's
# LANGUAGE_CODE_TO_NAME), for the ISO 639-1 codes among them.
LANGUAGES = {
    "ar": "Arabic",
    "zh": "Chinese",
    "cs": "Czech",
    "da": "Danish",
    "nl": "Dutch",
    "en": "English",
    "fi": "Finnish",
    "fr": "French",
    "de": "German",
    "el": "Greek",
    "hi": "Hindi",
    "hu": "Hungarian",
    "id": "Indonesian",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "mk": "Macedonian",
    "ms": "Malay",
    "fa": "Persian",
    "pl": "Polish",
    "pt": "Portuguese",
    "ro": "Romanian",
    "ru": "Russian",
    "es": "Spanish",
    "sv": "Swedish",
    "th": "Thai",
    "tr": "Turkish",
    "vi": "Vietnamese",
}
# What transformers appends to the text the assistant's turn is continued from, to find
# where the template puts it (continue_final_message).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _padded(clip: audio.Clip) -> audio.Clip:
    """The clip, zero-padded to MIN_SAMPLES where shorter."""
    missing = MIN_SAMPLES - len(clip.samples)
    if missing <= 0:
        return clip
    return audio.Clip(np.pad(clip.samples, (0, missing)), clip.name)


def clip_tokens(encoder: Qwen3ASRAudio, clip: audio.Clip) -> int:
    """The <|audio_pad|> tokens a clip takes, as Qwen3ASRProcessor counts them (one feature
    frame per 10 ms whole)."""
    frames = len(_padded(clip).samples) // audio.HOP_LENGTH
    return qwen3_omni_audio.clip_tokens(encoder.encoder.args, frames)


@torch.inference_mode()
def encode(encoder: Qwen3ASRAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    mel_bins = encoder.encoder.args.num_mel_bins
    out = []
    for clip in clips:
        features = audio.log_mel(_padded(clip).samples, mel_bins)
        out.append(encoder.encoder(torch.from_numpy(features), whole_chunks=True))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|audio_pad|> repeated for its clip's tokens, and the
    clips as generate() takes them. The text must mark exactly one place per clip."""
    return qwen3_omni_clips.prompt(tokenizer, text, embeds)


def transcription(
    tokenizer: Tokenizer,
    render: Callable[[list[dict]], str],
    language: str | None,
    context: str | None = None,
) -> str:
    """A transcription request's prompt text: the chat template (`render`, without the
    generation prompt) of a system turn of the `context` (words or names to expect) where
    one is given, a user turn of the clip and an assistant turn that the prompt continues,
    "language NAME<asr_text>" where a language (ISO 639-1) is given, else empty, cut where
    transformers cuts it for continue_final_message."""
    if tokenizer.token_id(AUDIO_PAD) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO_PAD}: not Qwen3-ASR's")
    if language is not None and language not in LANGUAGES:
        raise UsageError(
            f"language {language!r}: Qwen3-ASR transcribes {', '.join(sorted(LANGUAGES))}"
        )
    begun = "" if language is None else f"language {LANGUAGES[language]}{ASR_TEXT}"
    system = [{"role": "system", "content": [{"type": "text", "text": context}]}]
    messages = [
        *(system if context is not None else []),
        {"role": "user", "content": [{"type": "audio"}]},
        {"role": "assistant", "content": [{"type": "text", "text": begun + _CONTINUE_TAG}]},
    ]
    rendered = render(messages)
    tag = rendered.rfind(_CONTINUE_TAG.strip())
    if tag < 0 or begun.strip() not in rendered:
        raise UsageError("the chat template drops the assistant's text: no transcription prompt")
    if rendered.startswith(_CONTINUE_TAG, tag):
        return rendered[:tag]
    return rendered[:tag].rstrip()


def transcript(answer: str) -> str:
    """The transcription in the model's answer, as Qwen3ASRProcessor.parse_output reads
    it: the text after <asr_text> (all of it where there is none), stripped, after its
    repetition fix."""
    text = answer.strip()
    if not text:
        return ""
    if "assistant\n" in text:
        text = text.split("assistant\n", 1)[-1]
    text = _fix_pattern_repeats(_fix_char_repeats(text, 20), 20)
    if ASR_TEXT not in text:
        return text.strip()
    return text.split(ASR_TEXT, 1)[1].strip()


def _fix_char_repeats(text: str, threshold: int) -> str:
    """A character repeated more than `threshold` times in a row written once."""
    out, i = [], 0
    while i < len(text):
        run = 1
        while i + run < len(text) and text[i + run] == text[i]:
            run += 1
        out.append(text[i] if run > threshold else text[i : i + run])
        i += run
    return "".join(out)


def _fix_pattern_repeats(text: str, threshold: int, longest: int = 20) -> str:
    """The first pattern (of up to `longest` characters) repeated `threshold` times or
    more in a row written once, then the same for the text after its repeats (the
    original Qwen3-ASR's _detect_and_fix_repetitions)."""
    n = len(text)
    if n < threshold * 2:
        return text
    for i in range(n - threshold * 2 + 1):
        for k in range(1, longest + 1):
            if i + k * threshold > n:
                break
            pattern = text[i : i + k]
            if all(text[i + r * k : i + (r + 1) * k] == pattern for r in range(1, threshold)):
                end = i + threshold * k
                while end + k <= n and text[end : end + k] == pattern:
                    end += k
                return text[:i] + pattern + _fix_pattern_repeats(text[end:], threshold, longest)
    return text
