"""What the audio-taking families' tests against transformers share: two chirps written as
WAV files, a user turn of a clip and a question, and the rows transformers' language model
takes at a clip's places."""

from pathlib import Path

import torch
from voxtral_helpers import chirp, wav_bytes


def chirp_wavs(tmp: Path, long_seconds: float, short_seconds: float = 0.7) -> tuple[Path, Path]:
    """long.wav and short.wav in `tmp`: 16 kHz chirps (seeds 1 and 2) of these lengths."""
    long, short = tmp / "long.wav", tmp / "short.wav"
    long.write_bytes(wav_bytes(chirp(long_seconds, 16000, seed=1), 16000))
    short.write_bytes(wav_bytes(chirp(short_seconds, 16000, seed=2), 16000))
    return long, short


def audio_user_turn(question: str) -> list[dict]:
    """A chat of one user turn: a clip, then `question`."""
    return [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]}]


def placed(model, reference, token: int) -> torch.Tensor:
    """The rows transformers' language model takes at the places of `token` (the clip's)
    when `model` runs on the processor's inputs `reference`."""
    taken = {}

    def keep(module, args, kwargs):
        taken["embeds"] = kwargs["inputs_embeds"][0]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**reference)
    finally:
        hook.remove()
    return taken["embeds"][reference["input_ids"][0] == token]
