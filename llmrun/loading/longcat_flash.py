"""LongCat-Flash folders at the loader edge: the Hub's checkpoints (meituan-longcat/
LongCat-Flash-Chat) keep the multi-token-prediction module under model.mtp., which
transformers leaves unread and so does llmrun; their FP8 releases are refused. Each of
num_layers layers caches two attention blocks (llmrun.models.longcat_flash). llama.cpp has
no converter for LongCat-Flash: folders only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

MODEL_TYPE = "longcat_flash"
_MTP = "model.mtp."


def hf_weights(weights: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    """`weights` without the multi-token-prediction module; a quantized checkpoint is
    refused."""
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "?"
        raise UnsupportedError(
            f"{path}: {method} LongCat-Flash checkpoints are not supported; use a bf16 one"
        )
    return {name: w for name, w in weights.items() if not name.startswith(_MTP)}


def cache_layers(config: dict[str, Any]) -> int:
    """The attention blocks that keep keys: two a layer (num_hidden_layers, where a
    config gives no num_layers)."""
    layers = config.get("num_layers")
    if layers is None and isinstance(config.get("num_hidden_layers"), int):
        return 2 * (config["num_hidden_layers"] // 2)
    if not (isinstance(layers, int) and layers > 0):
        raise ModelFormatError(f"num_layers is {layers!r}, not a positive whole number")
    return 2 * layers
