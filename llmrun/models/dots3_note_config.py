"""Dots 3 Note's config.json as transformers' Dots3NoteTextConfig reads it, torch-free
(llmrun show sizes the KV cache from it): the layer types, the sliding layers' attention
shapes, each layer type's RoPE, from the released checkpoints' own names (swa_*, use_dsa,
sliding_window_size, swa_rope_theta, moe_shared_expert_intermediate_size,
first_k_dense_replace and moe_layer_freq) where transformers' names are absent; the
switches that ask for a model transformers' does not compute refused. The model:
llmrun/models/dots3_note.py.
"""

from __future__ import annotations

from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

FULL, INDEXED, SLIDING = "full_attention", "indexed_attention", "sliding_attention"
LAYER_TYPES = (FULL, INDEXED, SLIDING)
# What per_layer_config may set for a layer (Dots3NoteTextAttention reads these).
PER_LAYER_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "head_dim",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# Dots3NoteTextConfig's sliding layers where the released swa_* fields are absent.
SWA_DEFAULTS = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1024,
    "kv_lora_rank": 1024,
    "head_dim": 256,
    "qk_nope_head_dim": 192,
    "v_head_dim": 128,
}
DEFAULT_THETA, SWA_THETA = 80_000_000.0, 50_000.0
DEFAULT_WINDOW = 512
# The released config.json's switches, and the only values transformers' model computes.
FIXED = {
    "apply_mla_qkv_lora_rescale": True,
    "k_rope_only_layernorm": True,
    "attention_gate_type": "headwise",
    "swa_attention_gate_type": "headwise",
    "normalization": "RMSNorm",
    "final_norm": "RMSNorm",
    "use_dynamic_rsf": False,
    "moe_gating_fp32": False,
}


def transformers_names(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as Dots3NoteTextConfig reads it: layer_types, mlp_layer_types,
    sliding_window, the sliding layers' per_layer_config and each layer type's RoPE from
    the released config.json's names where those are absent; refused where a switch asks
    for a model transformers' does not compute."""
    text = config.get("text_config")
    if isinstance(text, dict):  # a multimodal config: its language model's
        config = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}
    config = dict(config)
    for name, value in FIXED.items():
        if name in config and config[name] != value:
            raise UnsupportedError(
                f"Dots 3 Note with {name} {config[name]!r} is not supported (transformers' "
                f"model computes {value!r})"
            )
    layers = config["num_hidden_layers"]
    if config.get("mlp_layer_types") is None:
        first, freq = config.get("first_k_dense_replace", 1), config.get("moe_layer_freq", 1)
        sparse = [
            i >= first and (bool(freq[i]) if isinstance(freq, list) else i % freq == 0)
            for i in range(layers)
        ]
        config["mlp_layer_types"] = ["sparse" if s else "dense" for s in sparse]
    config.pop("moe_layer_freq", None)
    use_dsa = config.get("use_dsa", None if "per_layer_config" in config else True)
    kinds = config.get("layer_types")
    if kinds is None:
        global_kind = FULL if use_dsa is False else INDEXED
        windowed = config.get("use_sliding_window", True)
        kinds = [
            global_kind if not windowed or i < 2 or i % 4 == 1 else SLIDING for i in range(layers)
        ]
    kinds = list(kinds)
    if use_dsa is not None:  # the released checkpoints call indexed layers "full"
        old, new = (FULL, INDEXED) if use_dsa else (INDEXED, FULL)
        kinds = [new if kind == old else kind for kind in kinds]
    config["layer_types"] = kinds
    if config.get("sliding_window") is None:
        config["sliding_window"] = config.get("sliding_window_size") or DEFAULT_WINDOW
    if "moe_shared_expert_intermediate_size" in config:
        config["shared_experts_intermediate_size"] = config["moe_shared_expert_intermediate_size"]
    if config.get("per_layer_config") is None:
        sliding = {k: config.get(f"swa_{k}", v) for k, v in SWA_DEFAULTS.items()}
        sliding["qk_rope_head_dim"] = config.get(
            "swa_qk_rope_head_dim", sliding["head_dim"] - sliding["qk_nope_head_dim"]
        )
        config["per_layer_config"] = {i: sliding for i, k in enumerate(kinds) if k == SLIDING}
    config["rope_parameters"] = _layer_ropes(config, kinds)
    return config


def _layer_ropes(config: dict[str, Any], kinds: list[str]) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE settings, as Dots3NoteTextConfig gives them."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if rope is None:
        theta = config.get("rope_theta", DEFAULT_THETA)
        swa_theta = config.get("swa_rope_theta", SWA_THETA)
        rope = {
            kind: {"rope_type": "default", "rope_theta": swa_theta if kind == SLIDING else theta}
            for kind in LAYER_TYPES
        }
    elif not set(rope) & set(LAYER_TYPES):  # one setting for every layer type
        rope = {kind: dict(rope) for kind in LAYER_TYPES}
    missing = sorted(set(kinds) - set(rope))
    if missing:
        raise ModelFormatError(f"rope_parameters gives none for {', '.join(missing)}")
    return {kind: {"rope_theta": DEFAULT_THETA, **rope[kind]} for kind in set(kinds)}


# Dots3NoteTextConfig's defaults of the sizes the KV cache holds.
CACHE_DEFAULTS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}


def cache_layout(config: dict[str, Any]) -> tuple[list[tuple[int, int]], list[int | None]]:
    """Each layer's cached (heads, width) and window (None: every key) for a Dots 3 Note
    config, as llmrun.models.dots3_note caches it: one latent head, kv_lora_rank +
    qk_rope_head_dim wide (the layer's own), and the indexer's key in an indexed layer."""
    config = transformers_names(config)
    sizes = {k: config.get(k) or v for k, v in CACHE_DEFAULTS.items()}
    overrides = {int(i): v for i, v in config["per_layer_config"].items()}
    shapes, windows = [], []
    for i, kind in enumerate(config["layer_types"]):
        layer = {**sizes, **overrides.get(i, {})}
        index = sizes["index_head_dim"] if kind == INDEXED else 0
        shapes.append((1, layer["kv_lora_rank"] + layer["qk_rope_head_dim"] + index))
        windows.append(config["sliding_window"] if kind == SLIDING else None)
    return shapes, windows
