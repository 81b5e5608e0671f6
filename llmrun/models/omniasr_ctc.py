"""OmniASR's CTC recognizers (OmniASRForCTC: hf-audio/omniasr-ctc-*): OmniASR's audio tower
(llmrun.models.omniasr_audio) over a clip's normalized samples, then a linear CTC head to
the vocabulary, a row per 20 ms. llmrun.omniasr_ctc decodes it.

Reference: transformers/models/omniasr_ctc/modular_omniasr_ctc.py (OmniASRForCTC).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.omniasr_audio import AudioTower, EncoderArgs


@dataclass
class ModelArgs:
    vocab_size: int = 10288
    audio_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.audio_config, dict):
            raise ModelFormatError(f"audio_config {self.audio_config!r} is not an object")
        self.audio = EncoderArgs.from_config(self.audio_config)  # its projector unused

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.audio_tower = AudioTower(args.audio)


class Model(nn.Module):
    """OmniASRForCTC under its module names: `logits` of a clip's normalized samples."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.omniasr_ctc decodes it
    transcribes = True
    family = "OmniASR CTC"

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Encoder(args)
        self.ctc_head = nn.Linear(args.audio.hidden_size, args.vocab_size)

    def logits(self, samples: torch.Tensor) -> torch.Tensor:
        """The CTC logits [frames, vocab] of a clip's normalized samples [samples]."""
        return self.ctc_head(self.model.audio_tower(samples))
