"""Moonshine Streaming at the loader edge: a Hugging Face folder (model_type
"moonshine_streaming") whose output head is its own unless tie_word_embeddings says it is
the token embedding (MoonshineStreamingConfig's default: untied), and what `show` says of
one.
"""

from __future__ import annotations

from typing import Any

from llmrun.loading import whisper

MODEL_TYPE = "moonshine_streaming"


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors, the output head tied to the token embedding where the config
    ties them and the file leaves it out (the same names as Whisper's)."""
    tied = config.get("tie_word_embeddings", False)
    return whisper.hf_weights(weights, {"tie_word_embeddings": tied})


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Moonshine Streaming folder: speech recognition, its
    layers, and its decoder's positions as the context length."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    encoder = {"num_hidden_layers": 6, **(config.get("encoder_config") or {})}
    return {
        "speech_recognition": (
            f"speech recognition: {encoder['num_hidden_layers']} encoder (sliding-window) and "
            f"{config.get('num_hidden_layers', 6)} decoder layers over raw 16 kHz audio"
        ),
        "context_length": config.get("max_position_embeddings", 4096),
        "embedding_model": False,
    }
