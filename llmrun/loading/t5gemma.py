"""T5Gemma and T5Gemma 2 folders (llmrun.models.t5gemma, llmrun.models.t5gemma2) at the loader
edge: the output head the decoder's embedding where the config ties them (transformers'
default, the Hub files' way) or the file leaves it out; T5Gemma 2's decoder embedding the
encoder's where the file leaves it out (transformers ties them), its end-of-image embedding
(`embed_tokens.eoi_embedding`) beside the table as the model holds it, and its image encoder
dropped (llmrun runs its text); and what `show` says of one. llama.cpp's converter has
neither family, so there are no GGUFs to read."""

from __future__ import annotations

from typing import Any

MODEL_TYPE, MODEL_TYPE_2 = "t5gemma", "t5gemma2"
MODEL_TYPES = (MODEL_TYPE, MODEL_TYPE_2)
HEAD = "lm_head.out_proj.weight"
ENCODER, DECODER = "model.encoder.", "model.decoder."
# T5Gemma 2's image encoder and projector, which llmrun does not run.
VISION = (f"{ENCODER}vision_tower.", f"{ENCODER}multi_modal_projector.")


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The folder's tensors as llmrun's model names them, and whether an image encoder was
    left out."""
    out = {k: w for k, w in weights.items() if not k.startswith(VISION)}
    if config.get("model_type") == MODEL_TYPE_2:
        out = {k.replace("embed_tokens.eoi_embedding", "eoi_embedding"): w for k, w in out.items()}
        for name in ("embed_tokens.weight", "eoi_embedding"):
            if DECODER + name not in out and ENCODER + name in out:
                out[DECODER + name] = out[ENCODER + name]
    tied = config.get("tie_word_embeddings", True) or HEAD not in out
    if tied and f"{DECODER}embed_tokens.weight" in out:
        out[HEAD] = out[f"{DECODER}embed_tokens.weight"]
    return out, any(k.startswith(VISION) for k in weights)


def info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a T5Gemma or T5Gemma 2 folder: text-to-text, its
    layers."""
    if config.get("model_type") not in MODEL_TYPES:
        return {}
    encoder, decoder = config.get("encoder"), config.get("decoder")
    if config.get("model_type") == MODEL_TYPE_2 and isinstance(encoder, dict):
        encoder = encoder.get("text_config")
    layers = [
        s.get("num_hidden_layers") if isinstance(s, dict) else None for s in (encoder, decoder)
    ]
    return {
        "text_to_text": (
            f"text-to-text (encoder-decoder): {layers[0]} encoder and {layers[1]} decoder layers"
        ),
        "embedding_model": False,
    }
