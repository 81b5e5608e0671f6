"""Parakeet folders (model_type parakeet_tdt, parakeet_rnnt, parakeet_ctc: transformers'
ParakeetForTDT, ParakeetForRNNT, ParakeetForCTC) as `show` describes them: speech
recognition by a FastConformer encoder and its decoder, with its layers and mel bins. The
tensors load under their own names (llmrun.models.parakeet).
"""

from __future__ import annotations

from typing import Any

from llmrun.models.parakeet import CTC, DEFAULTS, ENCODER_DEFAULTS, TDT

_DECODERS = {
    CTC: "a CTC head",
    TDT: "a token-and-duration transducer (TDT)",
    "parakeet_rnnt": "an RNN transducer",
}


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Parakeet folder; no context length (the encoder takes
    a whole clip)."""
    model_type = config.get("model_type")
    if model_type not in DEFAULTS:
        return {}
    encoder = {**ENCODER_DEFAULTS, **(config.get("encoder_config") or {})}
    return {
        "speech_recognition": (
            f"speech recognition: {encoder['num_hidden_layers']} encoder (FastConformer) "
            f"layers and {_DECODERS[model_type]}, {encoder['num_mel_bins']} mel bins"
        ),
        "context_length": None,
        "embedding_model": False,
    }
