"""Speech2Text at the loader edge: a Hugging Face folder (model_type "speech_to_text") whose
output head is the token embedding (save_pretrained leaves lm_head.weight out) unless
tie_word_embeddings is false, and what `show` says of one.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "speech_to_text"
EMBEDDING, HEAD = "model.decoder.embed_tokens.weight", "lm_head.weight"


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors, the output head the token embedding where the config ties them
    (Speech2TextConfig's default) and the file leaves it out."""
    if HEAD in weights or EMBEDDING not in weights or config.get("tie_word_embeddings") is False:
        return weights
    return {**weights, HEAD: weights[EMBEDDING]}


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Speech2Text folder: speech recognition, its layers, and
    its decoder's positions as the context length."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    return {
        "speech_recognition": (
            f"speech recognition: {config.get('encoder_layers', 12)} encoder and "
            f"{config.get('decoder_layers', 6)} decoder layers, "
            f"{config.get('input_feat_per_channel', 80)} mel bins"
        ),
        "context_length": config.get("max_target_positions", 1024),
        "embedding_model": False,
    }
