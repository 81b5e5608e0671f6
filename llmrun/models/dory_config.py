"""Dory's layer layout, torch-free (llmrun show sizes the KV cache from it): the Hub's
config.json lists each decoder layer as two blocks, an attention block and an "mlp"
one, and counts layers in blocks (DoryConfig.__post_init__ halves them back, and
to_dict writes them so again); the KV cache holds, besides one entry per layer, the
recurrent layers' entries of each loop after the first where each loop keeps its own
("per_loop"), as transformers' DoryModel appends them. The model: llmrun/models/dory.py.
"""

from __future__ import annotations

from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

MODEL_TYPE = "dory"
MLP_BLOCK = "mlp"
KV_CACHE_MODES = ("per_loop", "last_loop")
# DoryConfig's defaults, in layers (its block counts halved).
DEFAULT_LAYERS = 36
DEFAULT_INPUT_LAYERS = 8
DEFAULT_OUTPUT_LAYERS = 8
DEFAULT_WINDOW = 1024
_COUNTS = ("num_hidden_layers", "n_input_layers", "n_recurrent_layers", "n_output_layers")


def in_layers(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its layer counts and layer_types in layers, as DoryConfig holds
    them: where layer_types lists "mlp" blocks, every other entry from the first (each
    attention block; the others must be "mlp") and every count halved (those the file
    leaves out: DoryConfig's defaults in blocks, 2 x 8 input and output layers).
    n_recurrent_layers defaults to the layers neither input nor output."""
    kinds = config.get("layer_types")
    out = dict(config)
    if isinstance(kinds, list) and MLP_BLOCK in kinds:
        if kinds[1::2] != [MLP_BLOCK] * (len(kinds) // 2) or MLP_BLOCK in kinds[::2]:
            raise ModelFormatError(
                "dory layer_types must alternate an attention block and an 'mlp' block; "
                f"got {kinds!r:.120}"
            )
        block_defaults = {
            "num_hidden_layers": 2 * DEFAULT_LAYERS,
            "n_input_layers": 2 * DEFAULT_INPUT_LAYERS,
            "n_output_layers": 2 * DEFAULT_OUTPUT_LAYERS,
        }
        out["layer_types"] = kinds[::2]
        for name in _COUNTS:
            value = config.get(name, block_defaults.get(name))
            if value is not None:
                out[name] = _count(name, value) // 2
    for name in _COUNTS:
        if out.get(name) is not None:
            _count(name, out[name])
    layers = out.get("num_hidden_layers", DEFAULT_LAYERS)
    n_input = out.setdefault("n_input_layers", DEFAULT_INPUT_LAYERS)
    n_output = out.setdefault("n_output_layers", DEFAULT_OUTPUT_LAYERS)
    if out.get("n_recurrent_layers") is None:
        out["n_recurrent_layers"] = layers - n_input - n_output
    if n_input + out["n_recurrent_layers"] + n_output != layers:
        raise ModelFormatError(
            f"dory n_input_layers ({n_input}) + n_recurrent_layers "
            f"({out['n_recurrent_layers']}) + n_output_layers ({n_output}) must equal "
            f"num_hidden_layers ({layers})"
        )
    return out


def _count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelFormatError(f"dory {name} is {value!r}, not a whole number")
    return value


def default_layer_types(layers: int) -> list[str]:
    """DoryConfig's layer_types where a config gives none: every fourth layer global."""
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]


def check_loops(loops: Any, mode: Any) -> None:
    """Refuse a loop count below 1 or an unknown recurrent_kv_cache_mode."""
    if not isinstance(loops, int) or isinstance(loops, bool) or loops < 1:
        raise ModelFormatError(f"dory n_recurrent_loops is {loops!r}; it must be at least 1")
    if mode not in KV_CACHE_MODES:
        raise UnsupportedError(
            f"dory recurrent_kv_cache_mode {mode!r} is not supported "
            f"(supported: {', '.join(KV_CACHE_MODES)})"
        )


def cache_windows(
    layer_types: list[str],
    n_input: int,
    n_recurrent: int,
    loops: int,
    mode: str,
    window: int | None,
) -> list[int | None]:
    """One entry per KV cache layer, its sliding window (None: it keeps every position):
    the layers in order, then with "per_loop" the recurrent layers again for each loop
    after the first. With "last_loop" the earlier loops attend to the recurrent layers'
    entries before the last loop writes them (llmrun.models.dory), which a ring of the
    window would not hold: those layers keep every position."""
    windows = [window if kind == "sliding_attention" else None for kind in layer_types]
    recurrent = slice(n_input, n_input + n_recurrent)
    if mode == "last_loop" and loops > 1:
        windows[recurrent] = [None] * n_recurrent
        return windows
    return windows + windows[recurrent] * (loops - 1)


def layer_windows(config: dict[str, Any]) -> list[int | None]:
    """cache_windows of a config.json-style dict (in blocks or in layers)."""
    config = in_layers(config)
    layers = config.get("num_hidden_layers", DEFAULT_LAYERS)
    kinds = config.get("layer_types") or default_layer_types(layers)
    loops = config.get("n_recurrent_loops", 2)
    mode = config.get("recurrent_kv_cache_mode", "per_loop")
    check_loops(loops, mode)
    return cache_windows(
        kinds,
        config["n_input_layers"],
        config["n_recurrent_layers"],
        loops,
        mode,
        config.get("sliding_window") or DEFAULT_WINDOW,
    )
