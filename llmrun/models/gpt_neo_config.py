"""GPT-Neo's attention_types as GPTNeoConfig expands them, torch-free (llmrun show sizes
the KV cache from them): [[kinds, repeats], ...] lists each kind ("global": every
earlier position; "local": the last window_size) repeats times over; GPTNeoConfig's
default is [[["global", "local"], 12]]. The model: llmrun/models/gpt_neo.py.
"""

from __future__ import annotations

from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

MODEL_TYPE = "gpt_neo"
DEFAULT_ATTENTION_TYPES = [[["global", "local"], 12]]
DEFAULT_WINDOW = 256  # GPTNeoConfig's window_size
# GPT-Neo's attention kinds -> llmrun's layer types.
LAYER_TYPES = {"global": "full_attention", "local": "sliding_attention"}


def layer_types(attention_types: Any, layers: int) -> list[str]:
    """attention_types (None: the default) expanded to one llmrun layer type per layer,
    refused where a kind is unknown or the count is not `layers`."""
    groups = attention_types or DEFAULT_ATTENTION_TYPES
    try:
        kinds = [kind for group, repeats in groups for _ in range(repeats) for kind in group]
    except (TypeError, ValueError):
        raise ModelFormatError(
            f"attention_types {groups!r} is not a list of [kinds, repeats] pairs"
        ) from None
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedError(
            f"GPT-Neo attention type {unknown[0]!r} is not supported (supported: global, local)"
        )
    if len(kinds) != layers:
        raise ModelFormatError(
            f"attention_types lists {len(kinds)} layers, but num_layers is {layers}"
        )
    return [LAYER_TYPES[kind] for kind in kinds]


def layer_windows(config: dict[str, Any]) -> list[int | None]:
    """Each layer's window of a GPT-Neo config.json: window_size for local layers, None
    for global ones."""
    window = config.get("window_size") or DEFAULT_WINDOW
    layers = config.get("num_layers") or config.get("num_hidden_layers") or 24
    kinds = layer_types(config.get("attention_types"), layers)
    return [window if kind == "sliding_attention" else None for kind in kinds]
