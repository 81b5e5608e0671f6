"""Prompts with audio, for VibeVoice-ASR: each clip at 24 kHz scaled as
VibeVoiceAcousticTokenizerFeatureExtractor scales it (to -25 dB FS by its root mean
square, then down where a sample passes 1), zero-padded to a whole hop, encoded, and each
audio place the chat template marks (one <|box_start|>, between <|object_ref_start|> and
<|object_ref_end|>) repeated once per token, as VibeVoiceAsrProcessor expands it; its
<|AUDIO_DURATION|> becomes the clip's length in seconds, to two decimals.

The duration is not in the tokens (a token per 3200 samples begun): each encoding carries
its clip's as its `seconds` attribute, which prompt() reads.

A transcription's prompt is VibeVoiceAsrProcessor.apply_transcription_request's through
the chat template: a user turn of the clip, with the context text (OpenAI's `prompt`) as
its "extra info" where one is given; it takes no language. The model answers a JSON list
of segments ({"Start", "End", "Speaker", "Content"}, after "assistant"), whose contents
the transcript joins, as the processor's decode(return_format="transcription_only") does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence

import torch

from llmrun import audio, qwen2_audio_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.vibevoice_asr import SAMPLE_RATE, VibeVoiceAsrAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO = "<|box_start|>"
DURATION = "<|AUDIO_DURATION|>"


def samples(encoder: VibeVoiceAsrAudio, clip: audio.Clip) -> torch.Tensor:
    """A clip's 24 kHz samples as the feature extractor scales them, zero-padded to a whole
    hop."""
    x = torch.from_numpy(clip.at(SAMPLE_RATE)).float()
    if encoder.normalize:
        rms = torch.sqrt(torch.mean(x**2))
        x = x * (10 ** (encoder.target_db / 20) / (rms + encoder.eps))
        peak = torch.max(torch.abs(x))
        if peak > 1.0:
            x = x / (peak + encoder.eps)
    hop = encoder.encoder.args.acoustic.hop_length
    return torch.nn.functional.pad(x, (0, -len(x) % hop))


def clip_tokens(encoder: VibeVoiceAsrAudio, clip: audio.Clip) -> int:
    """The <|box_start|> tokens a clip takes: one per hop of its 24 kHz samples begun."""
    length = clip.length_at(SAMPLE_RATE)
    if length < 1:
        raise UsageError(f"{clip.name} holds no audio")
    return math.ceil(length / encoder.encoder.args.acoustic.hop_length)


@torch.inference_mode()
def encode(encoder: VibeVoiceAsrAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden], its length in seconds as
    their `seconds`."""
    out = []
    for clip in clips:
        rows = encoder.encoder(samples(encoder, clip))[: clip_tokens(encoder, clip)]
        rows.seconds = clip.length_at(SAMPLE_RATE) / SAMPLE_RATE
        out.append(rows)
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|AUDIO_DURATION|> its clip's seconds (in order) and
    each <|box_start|> repeated for its clip's tokens, and the clips as generate() takes
    them. The text must mark exactly one place per clip."""
    if not all(hasattr(e, "seconds") for e in embeds):
        raise ValueError("VibeVoice-ASR's clip encodings carry their seconds (encode's)")
    durations = iter(f"{e.seconds:.2f}" for e in embeds)
    if text.count(DURATION) > len(embeds):
        raise UsageError(f"the prompt has more {DURATION} than clips")
    text = re.sub(re.escape(DURATION), lambda _: next(durations), text)
    return qwen2_audio_clips.prompt(tokenizer, text, embeds, pad=AUDIO)


def transcription(
    tokenizer: Tokenizer,
    render: Callable[..., str],
    language: str | None,
    context: str | None = None,
) -> str:
    """A transcription request's prompt text: the chat template (`render`) of a user turn
    of the clip and the context text. A language is refused: the processor takes none."""
    if tokenizer.token_id(AUDIO) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not VibeVoice-ASR's")
    if language is not None:
        raise UsageError(
            f"language {language!r}: VibeVoice-ASR's transcription prompt takes no language "
            "(it transcribes the language it hears): leave language out"
        )
    content: list[dict] = [{"type": "audio"}]
    if context is not None:
        content.append({"type": "text", "text": context})
    return render([{"role": "user", "content": content}], add_generation_prompt=True)


def transcript(answer: str) -> str:
    """The segments' contents joined by spaces, as the processor's
    decode(return_format="transcription_only") reads an answer: the text after
    "assistant" parsed as a JSON list of segments (of a list cut short, its whole
    segments); an answer that does not parse is kept as it is (stripped)."""
    text = answer.strip()
    if text.startswith("assistant"):
        text = text[len("assistant") :].strip()
    if not text.startswith("["):
        return text
    try:
        segments = json.loads(text)
    except json.JSONDecodeError:
        segments = _whole_segments(text)
        if not segments:
            return text
    if not isinstance(segments, list) or not all(
        isinstance(s, dict) and "Content" in s for s in segments
    ):
        return text
    for segment in segments:
        for key in ("Start", "End"):
            value = segment.get(key)
            if value is not None and not isinstance(value, (int, float)):
                return text
    return " ".join(str(s.get("Content", "")) for s in segments).strip()


def _whole_segments(text: str) -> list:
    """The JSON objects a list cut short begins with."""
    decoder, separator = json.JSONDecoder(), re.compile(r"[\s,]*")
    segments, at = [], separator.match(text, 1).end()
    while at < len(text):
        try:
            segment, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        segments.append(segment)
        at = separator.match(text, at).end()
    return segments
