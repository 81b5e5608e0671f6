"""Moonshine at the loader edge: a Hugging Face folder (model_type "moonshine") whose
output head is the token embedding (save_pretrained leaves proj_out.weight out, as
Whisper's files do: tied unless tie_word_embeddings is false), and what `show` says of one.
"""

from __future__ import annotations

from typing import Any

from llmrun.loading import whisper

MODEL_TYPE = "moonshine"


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors with the output head tied to the token embedding where the
    file leaves it out (the same names as Whisper's)."""
    return whisper.hf_weights(weights, config)


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Moonshine folder: speech recognition, its layers, and
    its decoder's positions as the context length."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    return {
        "speech_recognition": (
            f"speech recognition: {config.get('encoder_num_hidden_layers')} encoder and "
            f"{config.get('decoder_num_hidden_layers')} decoder layers over raw 16 kHz audio"
        ),
        "context_length": config.get("max_position_embeddings"),
        "embedding_model": False,
    }
