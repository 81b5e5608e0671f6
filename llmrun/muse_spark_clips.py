"""Prompts with audio, for Muse Spark: each audio place (<|audio|>, which a message's audio
part is written as) expanded as MuseSparkProcessor expands it: <|soft_audio_start|>, one
<|audio|> per samples_per_token samples begun (1920 at 24 kHz: 80 ms), <|soft_audio_end|>;
each clip resampled to 24 kHz from the file's own rate (audio.Clip.at), zero-padded to whole tokens as MuseSparkFeatureExtractor pads it, and
encoded. Where the embeddings go is a multimodal.PromptImages, which the prefill places
as it places images.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmrun import audio
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.muse_spark_audio import SAMPLE_RATE, MuseSparkAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO, START, END = "<|audio|>", "<|soft_audio_start|>", "<|soft_audio_end|>"


def _waveform(clip: audio.Clip) -> np.ndarray:
    return clip.at(SAMPLE_RATE)


def clip_tokens(encoder: MuseSparkAudio, clip: audio.Clip) -> int:
    """The <|audio|> tokens a clip takes: one per samples_per_token samples begun."""
    tokens = -(-clip.length_at(SAMPLE_RATE) // encoder.encoder.args.samples_per_token)
    if tokens == 0:
        raise UsageError(f"{clip.name}: no samples")
    return tokens


@torch.inference_mode()
def encode(encoder: MuseSparkAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    step = encoder.encoder.args.samples_per_token
    out = []
    for clip in clips:
        samples = torch.from_numpy(_waveform(clip))
        padded = torch.nn.functional.pad(samples, (0, -len(samples) % step))
        out.append(encoder.encoder(padded[None])[0])
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|audio|> expanded for its clip, and where each clip's
    embeddings begin. The text must mark exactly one place per clip."""
    ids = [tokenizer.token_id(t) for t in (AUDIO, START, END)]
    if None in ids:
        raise TokenizerError(f"the tokenizer has no {AUDIO}, {START} or {END}: not Muse Spark's")
    places = text.count(AUDIO)
    if places != len(embeds):
        clips = len(embeds)
        raise UsageError(
            f"the prompt marks {places} audio place{'s' * (places != 1)} ({AUDIO}) for "
            f"{clips} clip{'s' * (clips != 1)}: write one {AUDIO} where each goes"
        )
    pieces = text.split(AUDIO)
    expanded = pieces[0] + "".join(
        START + AUDIO * len(e) + END + piece for e, piece in zip(embeds, pieces[1:], strict=True)
    )
    encoded = tokenizer.encode(expanded)
    starts = [i + 1 for i, t in enumerate(encoded) if t == ids[1]]
    if len(starts) != len(embeds):
        raise UsageError(f"the prompt holds {START} of its own: leave it to the audio places")
    return encoded, PromptImages(list(embeds), starts)
