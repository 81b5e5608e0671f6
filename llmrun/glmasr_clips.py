"""Prompts with audio, for GLM-ASR: each audio place the chat template marks (one <|pad|>,
between <|begin_of_audio|> and <|end_of_audio|>) expanded into as many <|pad|> as
GlmAsrProcessor gives the clip, and the clips encoded.

The processor cuts a clip into 30-second windows (at most 21: what is longer it cuts off,
which llmrun refuses instead), and WhisperFeatureExtractor zero-pads each to 30 seconds and
takes its log-mel spectrogram alone (its own maximum). The encoder runs on whole windows,
padding and all (GLM-ASR's tower attends over it), and each window keeps the tokens of
the frames its audio reaches (GlmAsrModel.get_audio_features): the convolutions halve the
10 ms frames, and 4 of theirs make a token, one per 80 ms. The prompt counts them over the
clip's frames as a whole, which comes to the same, a full window being 375 whole tokens.

A transcription's prompt is GlmAsrProcessor.apply_transcription_request's: one user turn
of the clip and the processor's instruction, with the generation prompt; it takes no
language (the model writes what it hears). Its answer is read as the processor's
decode(strip_prefix=True) reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from llmrun import audio, qwen2_audio_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.glmasr import GlmAsrAudio
from llmrun.models.glmasr_encoder import MERGE, WINDOW_FRAMES
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO = "<|pad|>"
WINDOW = WINDOW_FRAMES * audio.HOP_LENGTH  # samples of a 30-second window
MAX_WINDOWS = 655 // 30  # GlmAsrProcessor's max_audio_len (seconds) in whole windows
INSTRUCTION = "Please transcribe this audio into text"  # default_transcription_prompt
# The openings of an answer that decode(strip_prefix=True) takes away.
_PREFIXES = (
    "The spoken content of the audio is",
    "The transcription of the audio is",
    "The content of the input audio is",
)


def _windows(clip: audio.Clip) -> list[np.ndarray]:
    """The clip's 30-second windows (the last as long as what is left); a clip longer than
    MAX_WINDOWS of them is refused."""
    samples = clip.samples
    count = max(1, -(-len(samples) // WINDOW))
    if count > MAX_WINDOWS:
        raise UsageError(
            f"{clip.name}: {len(samples) / audio.SAMPLE_RATE:.1f} seconds of audio; GLM-ASR "
            f"takes {MAX_WINDOWS * WINDOW // audio.SAMPLE_RATE} seconds a clip at most "
            "(cut it into clips)"
        )
    return [samples[i * WINDOW : (i + 1) * WINDOW] for i in range(count)]


def _tokens(frames: int) -> int:
    """The tokens of `frames` mel frames: the second convolution halves them, then 4 a
    token (GlmAsrProcessor._get_audio_token_length)."""
    positions = (frames - 1) // 2 + 1
    return (positions - MERGE) // MERGE + 1


def _frames(window: np.ndarray) -> int:
    """The mel frames a window's audio reaches (the feature extractor's attention mask:
    one per 10 ms begun)."""
    return -(-len(window) // audio.HOP_LENGTH)


def clip_tokens(encoder: GlmAsrAudio, clip: audio.Clip) -> int:
    """The <|pad|> tokens a clip takes, as GlmAsrProcessor counts them; a clip too short
    for one is refused."""
    tokens = _tokens(sum(_frames(window) for window in _windows(clip)))
    if tokens < 1:
        raise UsageError(f"{clip.name}: {len(clip.samples)} samples, too short for GLM-ASR")
    return tokens


@torch.inference_mode()
def encode(encoder: GlmAsrAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    mel_bins = encoder.encoder.args.num_mel_bins
    out = []
    for clip in clips:
        clip_tokens(encoder, clip)  # refuses a clip too short
        kept = []
        # One window at a time (they never attend to each other), so that a long clip's
        # activations are held for one window, not up to 21.
        for window in _windows(clip):
            features = audio.log_mel(np.pad(window, (0, WINDOW - len(window))), mel_bins)
            rows = encoder.encoder(torch.from_numpy(features)[None])
            kept.append(rows[: _tokens(_frames(window))])
        out.append(torch.cat(kept))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|pad|> repeated for its clip's tokens, and the clips as
    generate() takes them. The text must mark exactly one place per clip."""
    return qwen2_audio_clips.prompt(tokenizer, text, embeds, pad=AUDIO)


def transcription(
    tokenizer: Tokenizer,
    render: Callable[..., str],
    language: str | None,
    context: str | None = None,
) -> str:
    """A transcription request's prompt text: the chat template (`render`, asked for the
    generation prompt) of a user turn of the clip and the processor's instruction. A
    language is refused: the processor takes none."""
    if tokenizer.token_id(AUDIO) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not GLM-ASR's")
    if language is not None:
        raise UsageError(
            f"language {language!r}: GLM-ASR's transcription prompt takes no language (it "
            "transcribes the language it hears): leave language out"
        )
    content = [{"type": "audio"}, {"type": "text", "text": INSTRUCTION}]
    return render([{"role": "user", "content": content}], add_generation_prompt=True)


def transcript(answer: str) -> str:
    """The transcription in the model's answer, as GlmAsrProcessor.decode(strip_prefix=True)
    reads it: stripped, without an opening such as "The spoken content of the audio is", a
    final period or the quotes around it."""
    text = answer.strip()
    for opening in _PREFIXES:
        if text.startswith(opening):
            text = text[len(opening) :].strip()
            break
    if text.endswith("."):
        text = text[:-1].strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].strip()
    return text
