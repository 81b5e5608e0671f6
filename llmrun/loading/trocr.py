"""TrOCR folders (a VisionEncoderDecoderModel of a ViT or DeiT encoder and a TrOCR decoder:
microsoft/trocr-*) at the loader edge: the decoder's config (TrOCRConfig, llmrun.models.trocr)
with what the outer config says of decoding (its decoder_start_token_id and special ids, and
an older folder's beams and lengths, which generate reads from it where there is no
generation_config.json), and the decoder's tensors under TrOCRForCausalLM's names (the
output projection the embedding where tie_word_embeddings says). The encoder's tensors are
the vision family's (llmrun.loading.trocr_vision). Other encoder/decoder pairs are refused by
name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

MODEL_TYPE = "vision-encoder-decoder"
DECODER_TYPE = "trocr"
ENCODER_TYPES = ("vit", "deit")
_PREFIX = "decoder."
HEAD = "output_projection.weight"
# How the loader's note ends, as llmrun.loading.vision.TEXT_ONLY: dropped once the image
# encoder loads.
TEXT_ONLY = "without the vision tower"
EMBEDDING = "model.decoder.embed_tokens.weight"
# The outer config's fields that the decoder's takes, where the outer one gives them.
_OUTER = (
    "decoder_start_token_id",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "num_beams",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "max_length",
    "min_length",
)


def check_pair(config: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The encoder's and decoder's configs of a vision-encoder-decoder config.json, refused
    unless they are a pair TrOCR's checkpoints use."""
    encoder, decoder = config.get("encoder"), config.get("decoder")
    if not isinstance(encoder, dict) or not isinstance(decoder, dict):
        raise ModelFormatError(
            f"{path}: a vision-encoder-decoder config without its encoder or decoder"
        )
    kinds = (encoder.get("model_type"), decoder.get("model_type"))
    if kinds[0] not in ENCODER_TYPES or kinds[1] != DECODER_TYPE:
        raise UnsupportedError(
            f"{path}: a vision-encoder-decoder of a {kinds[0]!r} encoder and a {kinds[1]!r} "
            f"decoder; llmrun runs TrOCR's ({' or '.join(ENCODER_TYPES)} and trocr)"
        )
    return encoder, decoder


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The decoder's config and tensors of a TrOCR folder."""
    encoder, decoder = check_pair(config, path)
    text = {**decoder, "model_type": DECODER_TYPE}
    text.update({k: config[k] for k in _OUTER if config.get(k) is not None})
    width = text.get("cross_attention_hidden_size") or text.get("d_model")
    if encoder.get("hidden_size", 768) != width:
        # VisionEncoderDecoderModel would add an enc_to_dec_proj, which TrOCR's never have.
        raise UnsupportedError(
            f"{path}: the encoder's width {encoder.get('hidden_size', 768)} is not the "
            f"decoder's cross-attention width {width}"
        )
    out = {k[len(_PREFIX) :]: w for k, w in weights.items() if k.startswith(_PREFIX)}
    if decoder.get("tie_word_embeddings", True) and EMBEDDING in out:
        out[HEAD] = out[EMBEDDING]
    return text, out


def info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a TrOCR folder: image-to-text, its layers."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    encoder, decoder = config.get("encoder"), config.get("decoder")
    layers = [
        s.get(k) if isinstance(s, dict) else None
        for s, k in ((encoder, "num_hidden_layers"), (decoder, "decoder_layers"))
    ]
    return {
        "text_to_text": (
            f"image-to-text (encoder-decoder): {layers[0]} image encoder and {layers[1]} "
            "decoder layers"
        ),
        "embedding_model": False,
    }
