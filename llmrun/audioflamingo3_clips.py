"""Prompts with audio, for Audio Flamingo 3: each audio place the chat template marks (one
<sound>) expanded into as many <sound> as AudioFlamingo3Processor gives the clip, and the
clips encoded.

The processor cuts a clip into 30-second windows (at most 20: what is longer it cuts off,
which llmrun refuses instead), and WhisperFeatureExtractor zero-pads each to 30 seconds and
takes its log-mel spectrogram alone (its own maximum). In each window the frames its audio
reaches attend only to each other (AudioFlamingo3Encoder's mask) and keep their tokens, one
per 40 ms (AudioFlamingo3Model.get_audio_features). The prompt counts them over the clip's
frames as a whole, which comes to the same, a full window being 750 whole tokens.

Music Flamingo's processor cuts clips of up to 40 windows, and writes each clip's tokens
between <|sound_bos|> and <|sound_eos|>; its encoder takes each window's index in its clip.
It documents no transcription prompt.

A transcription's prompt is AudioFlamingo3Processor.apply_transcription_request's: one
user turn of the processor's instruction and the clip, with the generation prompt; it
takes no language. Its answer is read as the processor's decode(strip_prefix=True) reads
it, as GLM-ASR's (whose processor shares it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from llmrun import audio, glmasr_clips, qwen2_audio_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.audioflamingo3 import AudioFlamingo3Audio, MusicFlamingoAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO = "<sound>"
WINDOW = 30 * audio.SAMPLE_RATE  # samples of a 30-second window
MAX_WINDOWS = 600 // 30  # AudioFlamingo3Processor's max_audio_len (seconds) in windows
MUSIC_MAX_WINDOWS = 1200 // 30  # MusicFlamingoProcessor's
MUSIC_BOS, MUSIC_EOS = "<|sound_bos|>", "<|sound_eos|>"
INSTRUCTION = "Transcribe the input speech."  # default_transcription_prompt
transcript = glmasr_clips.transcript


def _name(encoder: AudioFlamingo3Audio) -> str:
    return "Music Flamingo" if isinstance(encoder, MusicFlamingoAudio) else "Audio Flamingo 3"


def _windows(encoder: AudioFlamingo3Audio, clip: audio.Clip) -> list[np.ndarray]:
    """The clip's 30-second windows (the last as long as what is left); a clip longer than
    the family's processor takes is refused."""
    music = isinstance(encoder, MusicFlamingoAudio)
    most = MUSIC_MAX_WINDOWS if music else MAX_WINDOWS
    samples = clip.samples
    count = max(1, -(-len(samples) // WINDOW))
    if count > most:
        raise UsageError(
            f"{clip.name}: {len(samples) / audio.SAMPLE_RATE:.1f} seconds of audio; "
            f"{_name(encoder)} takes {most * WINDOW // audio.SAMPLE_RATE} seconds a clip at "
            "most (cut it into clips)"
        )
    return [samples[i * WINDOW : (i + 1) * WINDOW] for i in range(count)]


def _frames(window: np.ndarray) -> int:
    """The mel frames a window's audio reaches (the feature extractor's attention mask:
    one per 10 ms begun)."""
    return -(-len(window) // audio.HOP_LENGTH)


def _tokens(frames: int) -> int:
    """The tokens of `frames` mel frames: the second convolution halves them, the pool
    halves them again (AudioFlamingo3Processor._get_audio_token_length)."""
    positions = (frames - 1) // 2 + 1
    return (positions - 2) // 2 + 1


def clip_tokens(encoder: AudioFlamingo3Audio, clip: audio.Clip) -> int:
    """The <sound> tokens a clip takes, as AudioFlamingo3Processor counts them (and Music
    Flamingo's <|sound_bos|> and <|sound_eos|> around them); a clip too short for one is
    refused."""
    tokens = _tokens(sum(_frames(window) for window in _windows(encoder, clip)))
    if tokens < 1:
        raise UsageError(
            f"{clip.name}: {len(clip.samples)} samples, too short for {_name(encoder)}"
        )
    return tokens + 2 * isinstance(encoder, MusicFlamingoAudio)


@torch.inference_mode()
def encode(encoder: AudioFlamingo3Audio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [its <sound> tokens, text hidden]."""
    mel_bins = encoder.encoder.args.num_mel_bins
    music = isinstance(encoder, MusicFlamingoAudio)
    out = []
    for clip in clips:
        clip_tokens(encoder, clip)  # refuses a clip too short
        rows = []
        for index, window in enumerate(_windows(encoder, clip)):
            features, frames = _features(window, mel_bins), _frames(window)
            windowed = (index,) if music else ()
            rows.append(encoder.encoder(features, frames, *windowed))
        out.append(torch.cat(rows))
    return out


def _features(window: np.ndarray, mel_bins: int) -> torch.Tensor:
    """A window's log-mel features [1, mel bins, 3000], zero-padded to 30 seconds."""
    padded = np.pad(window, (0, WINDOW - len(window)))
    return torch.from_numpy(audio.log_mel(padded, mel_bins))[None]


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <sound> repeated for its clip's tokens, and the clips as
    generate() takes them. The text must mark exactly one place per clip."""
    return qwen2_audio_clips.prompt(tokenizer, text, embeds, pad=AUDIO)


def music_prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """Music Flamingo's prompt: as Audio Flamingo 3's, each clip's <sound> tokens between
    <|sound_bos|> and <|sound_eos|>."""
    for token in (MUSIC_BOS, MUSIC_EOS):
        if tokenizer.token_id(token) is None:
            raise TokenizerError(f"the tokenizer has no {token}: not Music Flamingo's")
    return prompt(tokenizer, text.replace(AUDIO, MUSIC_BOS + AUDIO + MUSIC_EOS), embeds)


def transcription(
    tokenizer: Tokenizer,
    render: Callable[..., str],
    language: str | None,
    context: str | None = None,
) -> str:
    """A transcription request's prompt text: the chat template (`render`, asked for the
    generation prompt) of a user turn of the processor's instruction and the clip. A
    language is refused: the processor takes none."""
    if tokenizer.token_id(AUDIO) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not Audio Flamingo 3's")
    if language is not None:
        raise UsageError(
            f"language {language!r}: Audio Flamingo 3's transcription prompt takes no "
            "language: leave language out"
        )
    content = [{"type": "text", "text": INSTRUCTION}, {"type": "audio"}]
    return render([{"role": "user", "content": content}], add_generation_prompt=True)
