"""BART, mBART, Marian and M2M100 (NLLB) at the loader edge: a folder's tensors under
llmrun.models.bart's names (the head the shared embedding, the stacks' copies of it dropped,
and Marian's and M2M100's sinusoidal position tables, which the model computes, whatever a
file kept of them; a zero final_logits_bias where the file has none, as transformers starts
it, and M2M100 never has), and what `show` says of one."""

from __future__ import annotations

from typing import Any

import torch

MODEL_TYPES = ("bart", "mbart", "marian", "m2m_100")
SHARED, HEAD, BIAS = "model.shared.weight", "lm_head.weight", "final_logits_bias"
COPIES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
SINUSOIDS = ("model.encoder.embed_positions.", "model.decoder.embed_positions.")


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight: type) -> dict[str, Any]:
    """The folder's tensors as llmrun's model names them; `weight`: the loader's Weight
    class, for the bias the file may leave out."""
    sinusoidal = config.get("model_type") in ("marian", "m2m_100")
    out = {
        k: w
        for k, w in weights.items()
        if k not in COPIES and not (sinusoidal and k.startswith(SINUSOIDS))
    }
    if SHARED not in out:
        for name in COPIES:  # a file that kept only a stack's copy
            if name in weights:
                out[SHARED] = weights[name]
                break
    if HEAD not in out and SHARED in out:
        out[HEAD] = out[SHARED]
    vocab_size = config.get("vocab_size")
    if BIAS not in out and isinstance(vocab_size, int) and vocab_size > 0:
        out[BIAS] = weight(torch.zeros(1, vocab_size))
    return out


def info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a BART, mBART, Marian or M2M100 folder: text-to-text, its
    layers."""
    if config.get("model_type") not in MODEL_TYPES:
        return {}
    return {
        "text_to_text": (
            f"text-to-text (encoder-decoder): {config.get('encoder_layers')} encoder and "
            f"{config.get('decoder_layers')} decoder layers"
        ),
        "embedding_model": False,
    }
