"""Voxtral Realtime at the loader edge: a Hugging Face folder (model_type "voxtral_realtime")
as transformers saves VoxtralRealtimeForConditionalGeneration (audio_tower.*,
multi_modal_projector.*, the language model as language_model.model.*, its output head
tied and left out), renamed to llmrun.models.voxtral_realtime's (the language model as
model.*, so that the loader ties lm_head to model.embed_tokens), and what `show` says of
one.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "voxtral_realtime"
_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors under the model's names."""
    renamed = {}
    for name, weight in weights.items():
        for old, new in _PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = weight
    return renamed


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Voxtral Realtime folder: speech recognition, its layers,
    and the text's positions as the context length."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    # VoxtralRealtimeConfig's sub-config defaults where the file leaves them out.
    audio = {"num_hidden_layers": 32, "num_mel_bins": 128, **(config.get("audio_config") or {})}
    text = {"num_hidden_layers": 26, "max_position_embeddings": 131072}
    text.update(config.get("text_config") or {})
    return {
        "speech_recognition": (
            f"streaming speech recognition: {audio['num_hidden_layers']} causal encoder and "
            f"{text['num_hidden_layers']} decoder layers, {audio['num_mel_bins']} mel bins"
        ),
        "context_length": text["max_position_embeddings"],
        "embedding_model": False,
    }
