"""Whisper at the loader edge: a Hugging Face folder (model_type "whisper") whose output
head is the token embedding (the Hub's files leave proj_out.weight out), what `show` says
of one, and whisper.cpp's ggml .bin files, refused by name (llama.cpp's world has no GGUF
of Whisper)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import UnsupportedError

MODEL_TYPE = "whisper"
EMBEDDING, HEAD = "model.decoder.embed_tokens.weight", "proj_out.weight"
# whisper.cpp's model files begin with GGML_FILE_MAGIC, 0x67676d6c, little-endian.
GGML_MAGIC = b"lmgg"


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors with the output head tied to the token embedding where the
    file leaves it out (WhisperConfig ties them unless tie_word_embeddings is false)."""
    if HEAD in weights or EMBEDDING not in weights or config.get("tie_word_embeddings") is False:
        return weights
    return {**weights, HEAD: weights[EMBEDDING]}


def refuse_ggml(path: Path) -> None:
    """Refuse a whisper.cpp model file (ggml-*.bin) in one line."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError:
        return  # the GGUF reader names the problem
    if magic == GGML_MAGIC:
        raise UnsupportedError(
            f"{path}: a whisper.cpp ggml model, which llmrun does not read; give a Whisper "
            "Hugging Face folder (config.json, model.safetensors, tokenizer.json, "
            "generation_config.json, preprocessor_config.json), e.g. openai/whisper-large-v3"
        )


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Whisper folder: speech recognition, its layers, and its
    decoder's positions as the context length."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    return {
        "speech_recognition": (
            f"speech recognition: {config.get('encoder_layers')} encoder and "
            f"{config.get('decoder_layers')} decoder layers, {config.get('num_mel_bins')} "
            "mel bins"
        ),
        "context_length": config.get("max_target_positions"),
        "embedding_model": False,
    }
