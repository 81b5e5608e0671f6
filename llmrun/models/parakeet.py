"""NVIDIA Parakeet speech recognition (ParakeetForCTC, ParakeetForRNNT, ParakeetForTDT):
Parakeet's FastConformer encoder (llmrun.models.parakeet_encoder's Conformer: normalized
log-mel frames -> one position per 8 frames) and, by config.json's model_type, either a CTC
head (a 1x1 convolution to the vocabulary, whose last id is the blank) or a transducer: the
encoder's positions projected to the joint's width, a prediction network (an embedding of
the last token, stacked LSTMs, a linear projection) and a joint network (the two added, an
activation, a linear head to the vocabulary and, for TDT, the durations after it). The
model gives the pieces; llmrun.parakeet decodes greedily with them.

Reference: transformers/models/parakeet/modeling_parakeet.py, configuration_parakeet.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import activation
from llmrun.models.parakeet_encoder import Conformer, EncoderArgs

# ParakeetEncoderConfig's fields read, and their defaults.
ENCODER_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    intermediate_size=4096,
    hidden_act="silu",
    attention_bias=True,
    convolution_bias=True,
    conv_kernel_size=9,
    subsampling_factor=8,
    subsampling_conv_channels=256,
    num_mel_bins=80,
    subsampling_conv_kernel_size=3,
    subsampling_conv_stride=2,
    scale_input=True,
)
CTC, RNNT, TDT = "parakeet_ctc", "parakeet_rnnt", "parakeet_tdt"
# Each config's defaults where config.json leaves a field out: ParakeetCTCConfig's (whose
# pad token is the blank) and ParakeetRNNTConfig's (ParakeetTDTConfig's too).
DEFAULTS: dict[str, dict[str, Any]] = {
    CTC: dict(vocab_size=1025, pad_token_id=1024),
    RNNT: dict(vocab_size=8193, blank_token_id=8192),
    TDT: dict(vocab_size=8193, blank_token_id=8192, durations=[0, 1, 2, 3, 4]),
}


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    blank_token_id: int  # CTC's: its pad_token_id
    encoder_config: dict[str, Any] = field(default_factory=dict)
    decoder_hidden_size: int = 640
    num_decoder_layers: int = 2
    hidden_act: str = "relu"
    max_symbols_per_step: int = 10
    durations: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model_type not in DEFAULTS:
            raise UnsupportedError(f"model_type {self.model_type!r} is not a Parakeet's")
        if not 0 <= self.blank_token_id < self.vocab_size:
            raise ModelFormatError(
                f"blank token {self.blank_token_id} outside the vocabulary of {self.vocab_size}"
            )
        activation(self.hidden_act)  # refuses an unknown one
        # transformers' generate advances by the duration head's argmax itself, as NeMo does
        # by durations[argmax] only where they are 0, 1, 2...
        if self.model_type == TDT and list(self.durations) != list(range(len(self.durations))):
            raise UnsupportedError(f"TDT durations {self.durations} (llmrun runs 0, 1, 2, ...)")
        if self.max_symbols_per_step < 1:
            raise ModelFormatError(f"max_symbols_per_step {self.max_symbols_per_step}")
        self.encoder = EncoderArgs.conformer(self.encoder_config, ENCODER_DEFAULTS)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config.get("model_type")
        values = {**DEFAULTS.get(model_type, {}), "model_type": model_type}
        names = [
            "vocab_size",
            "blank_token_id",
            "encoder_config",
            "decoder_hidden_size",
            "num_decoder_layers",
            "hidden_act",
            "max_symbols_per_step",
            "durations",
        ]
        values.update({n: config[n] for n in names if config.get(n) is not None})
        if model_type == CTC:
            values["blank_token_id"] = config.get("pad_token_id", values.pop("pad_token_id"))
        values.pop("pad_token_id", None)
        if model_type != TDT:
            values.pop("durations", None)
        return cls(**values)

    @property
    def transducer(self) -> bool:
        return self.model_type != CTC


class PredictionNetwork(nn.Module):
    """HF's ParakeetRNNTDecoder: the last token's embedding through stacked LSTMs and a
    linear projection."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = args.decoder_hidden_size
        self.embedding = nn.Embedding(args.vocab_size, width)
        self.lstm = nn.LSTM(width, width, num_layers=args.num_decoder_layers, batch_first=True)
        self.decoder_projector = nn.Linear(width, width)


class Joint(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.activation = activation(args.hidden_act)
        self.head = nn.Linear(args.decoder_hidden_size, args.vocab_size + len(args.durations))

    def forward(self, encoded: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
        return self.head(self.activation(encoded + predicted))


State = tuple[torch.Tensor, torch.Tensor] | None  # the LSTMs' hidden and cell states


class Model(nn.Module):
    """A Parakeet recognizer under transformers' module names: `encode` a clip's features,
    then `ctc_logits` (CTC), or `project` the encoding once and `predict` and `joint`
    (logits [vocab (+ durations)]) step by step (RNNT, TDT)."""

    generates = False  # not through llmrun's decoder-only loop: llmrun.parakeet decodes it
    transcribes = True
    family = "Parakeet"

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.encoder = Conformer(args.encoder)
        hidden = args.encoder.hidden_size
        if args.transducer:
            self.encoder_projector = nn.Linear(hidden, args.decoder_hidden_size)
            self.decoder = PredictionNetwork(args)
            self.joint = Joint(args)
        else:
            # A convolution of width 1, as NeMo's decoding layer is
            self.ctc_head = nn.Conv1d(hidden, args.vocab_size, kernel_size=1)

    def encode(self, features: torch.Tensor, valid: int) -> torch.Tensor:
        """A clip's features [frames, mel] (its first `valid` frames in the feature
        extractor's mask) -> the encoder's output [positions, hidden] at every position
        the frames subsample to (those past args.encoder.tokens(valid) outside the mask)."""
        if features.shape[1] != self.args.encoder.num_mel_bins:
            raise ValueError(f"Parakeet features of shape {list(features.shape)}")
        return self.encoder(features, valid)

    def ctc_logits(self, encoded: torch.Tensor) -> torch.Tensor:
        """The CTC head's logits [positions, vocab] of an encoding."""
        return self.ctc_head(encoded.T[None])[0].T

    def project(self, encoded: torch.Tensor) -> torch.Tensor:
        """An encoding [positions, hidden] in the joint's width [positions, decoder_hidden]."""
        return self.encoder_projector(encoded)

    def predict(self, token: int, state: State) -> tuple[torch.Tensor, State]:
        """The prediction network's output [decoder_hidden] after `token`, from `state`
        (None: zeros), and its state after."""
        decoder = self.decoder
        ids = torch.tensor([[token]], device=decoder.embedding.weight.device)
        out, state = decoder.lstm(decoder.embedding(ids), state)
        return decoder.decoder_projector(out[0, 0]), state
