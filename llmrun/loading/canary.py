"""Canary at the loader edge: a Hugging Face folder (model_type "canary") whose output
head's weight is the token embedding (save_pretrained leaves proj_out.weight out) unless
tie_word_embeddings is false (the bias is its own), without the NeMo featurizer's
tensors transformers ignores (preprocessor.featurizer.*: the features are the feature
extractor's, llmrun.canary); and what `show` says of one.

Reference: transformers/models/canary/modeling_canary.py (_tied_weights_keys,
_keys_to_ignore_on_load_unexpected).
"""

from __future__ import annotations

from typing import Any

from llmrun.loading.whisper import EMBEDDING, HEAD

MODEL_TYPE = "canary"
_FEATURIZER = "preprocessor.featurizer."


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors, the featurizer's left out, the output head's weight the token
    embedding unless tie_word_embeddings is false (as transformers ties it, whether or
    not the file holds one)."""
    kept = {name: w for name, w in weights.items() if not name.startswith(_FEATURIZER)}
    if config.get("tie_word_embeddings") is not False and EMBEDDING in kept:
        kept[HEAD] = kept[EMBEDDING]
    return kept


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Canary folder: speech recognition and translation, its
    layers, and its decoder's positions as the context length."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    # CanaryConfig's sub-config defaults where the file leaves them out.
    encoder = {"num_hidden_layers": 32, "num_mel_bins": 128, **(config.get("encoder_config") or {})}
    decoder = {"num_hidden_layers": 8, "max_position_embeddings": 1024}
    decoder.update(config.get("decoder_config") or {})
    return {
        "speech_recognition": (
            f"speech recognition and translation: {encoder['num_hidden_layers']} encoder "
            f"(FastConformer) and {decoder['num_hidden_layers']} decoder layers, "
            f"{encoder['num_mel_bins']} mel bins"
        ),
        "context_length": decoder["max_position_embeddings"],
        "embedding_model": False,
    }
