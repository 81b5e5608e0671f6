"""Pix2Struct folders (Pix2StructForConditionalGeneration: google/pix2struct-*) at the loader
edge: the text decoder's config as T5's (llmrun.models.pix2struct: its hidden_size as
d_model, its gated dense_act_fn, no output scaling) and its tensors under T5's names; the
image encoder's (encoder.*) are the vision family's (llmrun.loading.pix2struct_vision).
No llama.cpp converter writes Pix2Struct: folders only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError

MODEL_TYPE = "pix2struct"
# How the loader's note ends, as llmrun.loading.vision.TEXT_ONLY: dropped once the image
# encoder loads.
TEXT_ONLY = "without the vision tower"
# Pix2StructTextConfig's defaults, under T5's names.
_DEFAULTS = {
    "vocab_size": 50244,
    "hidden_size": 768,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 12,
    "num_heads": 12,
    "dense_act_fn": "gelu_new",
}
# A decoder layer's parts -> T5's (its block's layer.0, .1, .2 and their modules).
_PARTS = {
    "self_attention.attention.": "layer.0.SelfAttention.",
    "self_attention.layer_norm.": "layer.0.layer_norm.",
    "encoder_decoder_attention.attention.": "layer.1.EncDecAttention.",
    "encoder_decoder_attention.layer_norm.": "layer.1.layer_norm.",
    "mlp.DenseReluDense.": "layer.2.DenseReluDense.",
    "mlp.layer_norm.": "layer.2.layer_norm.",
}
_PROJECTIONS = {"query": "q", "key": "k", "value": "v", "output": "o"}
_PROJECTION = re.compile(r"Attention\.(query|key|value|output)\.")
_LAYER = re.compile(r"^decoder\.layer\.(\d+)\.(.*)$")
HEAD, EMBEDDING = "lm_head.weight", "shared.weight"


def _t5_name(name: str) -> str | None:
    """A decoder tensor's name in llmrun.models.pix2struct (None: not the decoder's)."""
    if name == "decoder.embed_tokens.weight":
        return EMBEDDING
    if name == "decoder.lm_head.weight":
        return HEAD
    if name.startswith("decoder.final_layer_norm."):
        return name
    layer = _LAYER.match(name)
    if layer is None:
        return None
    index, rest = layer.groups()
    for old, new in _PARTS.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
            break
    rest = _PROJECTION.sub(lambda m: f"Attention.{_PROJECTIONS[m[1]]}.", rest)
    return f"decoder.block.{index}.{rest}"


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text decoder's config (T5's fields) and tensors of a Pix2Struct folder."""
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ModelFormatError(f"{path}: Pix2Struct's text_config is not an object")
    text = {**_DEFAULTS, **text}
    out = {
        "model_type": MODEL_TYPE,
        "vocab_size": text["vocab_size"],
        "d_model": text["hidden_size"],
        "d_kv": text["d_kv"],
        "d_ff": text["d_ff"],
        "num_layers": text["num_layers"],
        "num_heads": text["num_heads"],
        "feed_forward_proj": f"gated-{text['dense_act_fn']}",
        "scale_decoder_outputs": False,
    }
    for name in ("relative_attention_num_buckets", "relative_attention_max_distance"):
        if text.get(name) is not None:
            out[name] = text[name]
    if text.get("layer_norm_epsilon") is not None:
        out["layer_norm_epsilon"] = text["layer_norm_epsilon"]
    for name in ("decoder_start_token_id", "pad_token_id", "eos_token_id", "bos_token_id"):
        value = config.get(name, text.get(name))
        if value is not None:
            out[name] = value
    out.setdefault("decoder_start_token_id", 0)  # Pix2StructTextConfig's: its pad
    renamed = {}
    for name, weight in weights.items():
        new = _t5_name(name)
        if new is not None:
            renamed[new] = weight
    tied = config.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False)
    if HEAD not in renamed and tied and EMBEDDING in renamed:
        renamed[HEAD] = renamed[EMBEDDING]
    return out, renamed


def info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Pix2Struct folder: image-to-text, its layers."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    layers = [
        s.get(k) if isinstance(s, dict) else None
        for s, k in (
            (config.get("vision_config"), "num_hidden_layers"),
            (config.get("text_config"), "num_layers"),
        )
    ]
    return {
        "text_to_text": (
            f"image-to-text (encoder-decoder): {layers[0]} image encoder and {layers[1]} "
            "decoder layers"
        ),
        "embedding_model": False,
    }
