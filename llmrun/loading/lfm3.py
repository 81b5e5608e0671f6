"""LFM3's layer pattern as `llmrun show` reads it without torch: which layers attend
(and so keep keys and values), as llmrun.models.lfm3.ModelArgs reads layer_types."""

from __future__ import annotations

from typing import Any

ATTENTION_TYPES = ("full_attention", "sliding_attention")


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many of an lfm3 config's layers attend, full or sliding (Lfm3Config's
    pattern where layer_types is absent: layers 2, 4, 6, 8, ...); None for another
    config."""
    if config.get("model_type") != "lfm3":
        return None
    kinds = config.get("layer_types")
    if kinds is not None:
        return sum(kind in ATTENTION_TYPES for kind in kinds)
    return sum(
        i % 4 == 2 or (i % 4 == 0 and i > 0) for i in range(int(config["num_hidden_layers"]))
    )
