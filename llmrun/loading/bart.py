"""BART-family folders (llmrun.models.bart: BART, mBART, Marian, M2M100/NLLB, PEGASUS,
Blenderbot, Blenderbot Small, MVP, LED) and PEGASUS-X ones (llmrun.models.pegasus_x) at the
loader edge: a folder's tensors under the model's names (the head the shared embedding, the
stacks' copies of it dropped, and the sinusoidal position tables of Marian, M2M100 and
PEGASUS, which the model computes, whatever a file kept of them; a zero final_logits_bias
where the file has none, as transformers starts it, and M2M100 and PEGASUS-X never have),
and what `show` says of one. LED's tensors move from led. to model., and its encoder's
attention (Longformer's query, key, value and output) takes BART's names; its
global-attention projections (query_global, key_global, value_global) are dropped: llmrun,
as transformers' generate without a global_attention_mask, gives no token global
attention."""

from __future__ import annotations

import re
from typing import Any

import torch

from llmrun.models.bart import LAYOUTS

MODEL_TYPES = (*LAYOUTS, "pegasus_x")
SHARED, HEAD, BIAS = "model.shared.weight", "lm_head.weight", "final_logits_bias"
COPIES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
SINUSOIDS = ("model.encoder.embed_positions.", "model.decoder.embed_positions.")
LONGFORMER = re.compile(
    r"(model\.encoder\.layers\.\d+\.self_attn\.)(?:longformer_self_attn\.)?(\w+)\."
)
LONGFORMER_NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "out_proj"}


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight: type) -> dict[str, Any]:
    """The folder's tensors as llmrun's model names them; `weight`: the loader's Weight
    class, for the bias the file may leave out."""
    layout = LAYOUTS.get(config.get("model_type"))
    sinusoidal = layout is not None and layout.positions != "learned"
    if config.get("model_type") == "led":
        weights = {_led_name(k): w for k, w in weights.items() if "_global." not in k}
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
    if BIAS not in out and layout is not None and isinstance(vocab_size, int) and vocab_size > 0:
        out[BIAS] = weight(torch.zeros(1, vocab_size))
    return out


def _led_name(key: str) -> str:
    """An LED tensor's name in BART's layout: under model., not led. (LEDModel's prefix in
    LEDForConditionalGeneration)."""
    if key.startswith("led."):
        key = "model." + key[len("led.") :]
    match = LONGFORMER.match(key)
    if match is None or match.group(2) not in LONGFORMER_NAMES:
        return key
    return f"{match.group(1)}{LONGFORMER_NAMES[match.group(2)]}.{key[match.end() :]}"


def info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a BART-family folder: text-to-text, its layers."""
    if config.get("model_type") not in MODEL_TYPES:
        return {}
    return {
        "text_to_text": (
            f"text-to-text (encoder-decoder): {config.get('encoder_layers')} encoder and "
            f"{config.get('decoder_layers')} decoder layers"
        ),
        "embedding_model": False,
    }
