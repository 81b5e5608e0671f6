"""Kolibri-1.1's layer layout as Kolibri1_1Config.__post_init__ fills it in, torch-free
(llmrun show sizes the KV cache from it): sliding-window layers and indexed-attention
layers (every fifth by default), the indexers among the latter (index_layers: by default
the 1st, 3rd, 4th and 6th indexed layer), the layer whose keys and values each layer
attends to (kv_source_layers: by default the 2nd, 3rd and 10th indexed layers read the
1st's, the 7th to 9th the 6th's), and the dense layers (mlp_only_layers: the first two).
Only the layers that make their own keys and values keep KV cache entries. The model:
llmrun/models/kolibri1_1.py.
"""

from __future__ import annotations

from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

MODEL_TYPE = "kolibri1_1"
SLIDING, INDEXED = "sliding_attention", "indexed_attention"
DEFAULT_LAYERS = 50
DEFAULT_WINDOW = 513
INDEXERS = (0, 2, 3, 5)  # of the indexed layers, those that choose a new pool
# For each indexed layer, the indexed layer whose keys and values it reads.
DEFAULT_SOURCES = (0, 0, 0, 3, 4, 5, 5, 5, 5, 0)
DENSE_LAYERS = (0, 1)


def layout(config: dict[str, Any]) -> dict[str, Any]:
    """layer_types, index_layers, kv_source_layers and mlp_only_layers of a config.json-
    style dict, filled in as transformers does, and checked as it checks them."""
    layers = config.get("num_hidden_layers") or DEFAULT_LAYERS
    kinds = config.get("layer_types") or [
        INDEXED if (i + 1) % 5 == 0 else SLIDING for i in range(layers)
    ]
    unknown = sorted(set(kinds) - {SLIDING, INDEXED})
    if unknown:
        raise UnsupportedError(
            f"Kolibri-1.1 layer type {unknown[0]!r} is not supported "
            f"(supported: {SLIDING}, {INDEXED})"
        )
    if len(kinds) != layers:
        raise ModelFormatError(
            f"layer_types lists {len(kinds)} layers, but num_hidden_layers is {layers}"
        )
    indexed = [i for i, kind in enumerate(kinds) if kind == INDEXED]
    index_layers = config.get("index_layers")
    if index_layers is None:
        index_layers = [indexed[i] for i in INDEXERS if i < len(indexed)]
    sources = config.get("kv_source_layers")
    if sources is None:
        if len(indexed) > len(DEFAULT_SOURCES):
            raise ModelFormatError(
                f"Kolibri-1.1 with {len(indexed)} indexed-attention layers needs "
                "kv_source_layers (the default covers 10)"
            )
        sources = list(range(layers))
        for layer, source in zip(indexed, DEFAULT_SOURCES, strict=False):
            sources[layer] = indexed[source]
    dense = config.get("mlp_only_layers")
    if dense is None:
        dense = [i for i in DENSE_LAYERS if i < layers]
    _check(kinds, indexed, index_layers, sources)
    return {
        "layer_types": list(kinds),
        "index_layers": list(index_layers),
        "kv_source_layers": list(sources),
        "mlp_only_layers": list(dense),
    }


def _check(kinds: list[str], indexed: list[int], index_layers: Any, sources: Any) -> None:
    if sorted(set(index_layers)) != list(index_layers) or not set(index_layers) <= set(indexed):
        raise ModelFormatError(
            f"index_layers must be increasing indexed-attention layers, got {index_layers!r}"
        )
    if indexed and indexed[0] not in index_layers:
        raise ModelFormatError("the first indexed-attention layer must be in index_layers")
    if not isinstance(sources, list) or len(sources) != len(kinds):
        raise ModelFormatError("kv_source_layers needs one entry per layer")
    for layer, source in enumerate(sources):
        if (
            not isinstance(source, int)
            or not 0 <= source <= layer
            or sources[source] != source
            or kinds[source] != kinds[layer]
        ):
            raise ModelFormatError(
                f"layer {layer} cannot read the keys and values of layer {source!r}: it must "
                "be an earlier layer of its type that makes its own"
            )


def cache_windows(config: dict[str, Any]) -> list[int | None]:
    """Per KV cache entry (each layer that makes its own keys and values, in order), its
    sliding window, None for the indexed layers, which keep every position."""
    filled = layout(config)
    window = config.get("sliding_window") or DEFAULT_WINDOW
    return [
        window if kind == SLIDING else None
        for layer, kind in enumerate(filled["layer_types"])
        if filled["kv_source_layers"][layer] == layer
    ]
