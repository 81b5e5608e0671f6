"""Prompts with audio, for Nemotron 3 Nano Omni: each clip's log-mel features as
transformers' ParakeetFeatureExtractor computes them (pre-emphasis, a centered STFT of
512 points over 400-sample symmetric Hann windows every 160 samples, zero-padded, power
through Slaney's mel bank, natural log above 2^-24, each mel bin normalized over the
clip's frames but the last, which is zeroed), encoded (llmrun.models.parakeet_encoder),
and each audio place that the chat template marks (<so_embedding>) expanded as
NemotronH_Omni_Reasoning_V3Processor expands it: <so_start>, one <so_embedding> per token,
<so_end>. A clip goes to the language model in place of its <so_embedding> tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmrun import audio, multimodal
from llmrun.errors import TokenizerError, UsageError
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO, AUDIO_START, AUDIO_END = "<so_embedding>", "<so_start>", "<so_end>"
N_FFT, WINDOW, HOP = 512, 400, 160
PREEMPHASIS = 0.97
LOG_GUARD = 2.0**-24
EPSILON = 1e-5


def features(samples: np.ndarray, mel_bins: int) -> torch.Tensor:
    """The normalized log-mel features [len(samples) // 160 + 1, mel_bins] of 16 kHz
    samples, the last frame zeroed (outside the extractor's mask)."""
    x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    x = torch.cat([x[:1], x[1:] - PREEMPHASIS * x[:-1]])
    window = torch.hann_window(WINDOW, periodic=False)
    stft = torch.stft(
        x[None], N_FFT, HOP, WINDOW, window=window, return_complex=True, pad_mode="constant"
    )
    power = torch.view_as_real(stft).pow(2).sum(-1).sqrt().pow(2)[0]  # [bins, frames]
    bank = torch.from_numpy(audio.mel_filters(mel_bins, n_fft=N_FFT).astype(np.float32).T)
    mel = torch.log(bank @ power + LOG_GUARD).T  # [frames, mel]
    valid = len(samples) // HOP
    mean = mel[:valid].sum(0) / valid
    std = (((mel[:valid] - mean) ** 2).sum(0) / (valid - 1)).sqrt()
    out = (mel - mean) / (std + EPSILON)
    out[valid:] = 0
    return out


def _checked(clip: audio.Clip) -> np.ndarray:
    """A clip's samples, of at least two frames (the normalization's variance needs them)."""
    if len(clip.samples) < 2 * HOP:
        raise UsageError(f"{clip.name}: under {2 * HOP} samples (20 ms), too short to hear")
    return clip.samples


def clip_tokens(encoder, clip: audio.Clip) -> int:
    """How many <so_embedding> tokens a clip takes, known before encoding it."""
    return encoder.args.tokens(len(_checked(clip)) // HOP + 1)


@torch.inference_mode()
def encode(encoder, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's tokens [tokens, hidden], encoded one at a time."""
    mel_bins = encoder.args.num_mel_bins
    return [encoder(features(_checked(clip), mel_bins)) for clip in clips]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <so_embedding> made <so_start>, one <so_embedding> per
    token of the clip `encoded` (in order), <so_end>; and the clips as generate() takes
    them."""
    missing = [t for t in (AUDIO_START, AUDIO_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(
            f"the tokenizer has no {', '.join(missing)}: not Nemotron 3 Nano Omni's"
        )
    framed = text.replace(AUDIO, AUDIO_START + AUDIO + AUDIO_END)
    return multimodal.pad_prompt(tokenizer, framed, encoded, AUDIO, "Nemotron 3 Nano Omni")
