"""OmniASR's CTC speech recognition (llmrun.models.omniasr_ctc), as transformers'
OmniASRCTCProcessor prepares a clip and OmniASRForCTC.generate decodes it greedily: the
clip's samples normalized as OmniASRFeatureExtractor does (llmrun.omniasr_clips), the
whole clip through the model, each frame's argmax, then as the processor's decode(...,
skip_special_tokens=True) reads the ids (ParakeetTokenizer's): repeats collapsed, the pad
token dropped, special tokens skipped. It predicts no language and takes no prompt; it
gives no times.

Reference: transformers/models/omniasr_ctc/modular_omniasr_ctc.py (OmniASRForCTC.generate),
processing_omniasr_ctc.py, parakeet/tokenization_parakeet.py (_decode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmrun import audio, omniasr_clips, parakeet, seq2seq, wav2vec2
from llmrun.errors import UsageError
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

FAMILY = "OmniASR CTC"


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
) -> Transcription:
    """A clip's transcript by an OmniASR CTC `model` loaded from `folder`."""
    if language is not None:
        raise UsageError(f"{FAMILY} takes no language (it transcribes the language it hears)")
    seq2seq.only_transcribes(task, prompt, FAMILY)
    if model.args.audio.frames(len(clip.samples)) < 1:
        raise UsageError(f"{clip.name}: {len(clip.samples)} samples, too short for {FAMILY}")
    head = model.ctc_head.weight
    samples = omniasr_clips.normalized(torch.tensor(clip.samples, dtype=torch.float32))
    with torch.inference_mode():
        best = model.logits(samples.to(head.device, head.dtype)).argmax(-1).tolist()
    ids = wav2vec2.ctc_collapse(best, {parakeet.pad_id(folder, tokenizer)})
    return Transcription(tokenizer.decode(ids, skip_special=True), ids, None, 0)
