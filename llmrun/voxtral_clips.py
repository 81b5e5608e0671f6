"""Prompts with audio, for Voxtral: each audio place the chat template marks
([BEGIN_AUDIO], as mistral_common writes an audio part) followed by the clip's [AUDIO]
tokens, 375 per 30-second chunk (the clip zero-padded to whole chunks), and the clips
encoded chunk by chunk; where their embeddings go is a multimodal.PromptImages, which the
prefill places as it places images. A transcription's prompt is mistral_common's
(InstructTokenizerV7.encode_transcription).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import audio
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.voxtral_audio import VoxtralAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

BEGIN_AUDIO, AUDIO, TRANSCRIBE = "[BEGIN_AUDIO]", "[AUDIO]", "[TRANSCRIBE]"


def clip_tokens(encoder: VoxtralAudio, clip: audio.Clip) -> int:
    """The [AUDIO] tokens a clip takes: mistral_common's count for audio padded to whole
    chunks (one token per 8 mel frames, 375 a chunk)."""
    return _chunks(encoder, clip) * encoder.tokens_per_chunk


def _chunks(encoder: VoxtralAudio, clip: audio.Clip) -> int:
    chunk = encoder.encoder.args.chunk_frames * audio.HOP_LENGTH
    return -(-len(clip.samples) // chunk)


@torch.inference_mode()
def encode(encoder: VoxtralAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden], a chunk at a time (a
    30-second chunk's attention over 1500 frames is what takes memory)."""
    args = encoder.encoder.args
    seconds = args.chunk_frames * audio.HOP_LENGTH // audio.SAMPLE_RATE
    out = []
    for clip in clips:
        features = torch.from_numpy(audio.chunked_features(clip, args.num_mel_bins, seconds))
        out.append(torch.cat([encoder.encoder(chunk[None]) for chunk in features]))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each [BEGIN_AUDIO] followed by its clip's [AUDIO] tokens, and
    where each clip's embeddings begin. The text must mark exactly one place per clip."""
    begin, token = tokenizer.token_id(BEGIN_AUDIO), tokenizer.token_id(AUDIO)
    if begin is None or token is None:
        raise TokenizerError(f"the tokenizer has no {BEGIN_AUDIO} or {AUDIO}: not Voxtral's")
    places = text.count(BEGIN_AUDIO)
    if places != len(embeds):
        clips = len(embeds)
        raise UsageError(
            f"the prompt marks {places} audio place{'s' * (places != 1)} ({BEGIN_AUDIO}) for "
            f"{clips} clip{'s' * (clips != 1)}: write {BEGIN_AUDIO} where each goes"
        )
    pieces = text.split(BEGIN_AUDIO)
    expanded = pieces[0] + "".join(
        BEGIN_AUDIO + AUDIO * len(e) + piece for e, piece in zip(embeds, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts = [i + 1 for i, t in enumerate(ids) if t == begin]
    runs_fit = all(
        ids[s : s + len(e)] == [token] * len(e) for s, e in zip(starts, embeds, strict=True)
    )
    if not runs_fit or ids.count(token) != sum(len(e) for e in embeds):
        raise UsageError(f"the prompt holds {AUDIO} of its own: remove it")
    return ids, PromptImages(list(embeds), starts)


def transcription(tokenizer: Tokenizer, language: str | None) -> str:
    """A transcription request's prompt text, as mistral_common lays it out: BOS, a user
    turn of the one clip, `lang:LANGUAGE` where the language is given, then [TRANSCRIBE]."""
    if tokenizer.token_id(TRANSCRIBE) is None:
        raise TokenizerError(f"the tokenizer has no {TRANSCRIBE}: not Voxtral's")
    bos = "" if tokenizer.bos_id is None else tokenizer.token_to_piece(tokenizer.bos_id)
    spoken = "" if language is None else f"lang:{language}"
    return f"{bos}[INST]{BEGIN_AUDIO}[/INST]{spoken}{TRANSCRIBE}"
