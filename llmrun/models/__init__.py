"""Registry: Hugging Face model_type -> the module that implements it.

Each module has `ModelArgs.from_config(config_dict)` and `Model(args)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from llmrun.errors import UnsupportedError

ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "ministral3": "ministral3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",  # multimodal: its text_config's language model
    "gemma3_text": "gemma3",
    "gemma3n": "gemma3n",  # multimodal: its text_config's language model
    "gemma3n_text": "gemma3n",
    "gpt_oss": "gpt_oss",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "mistral4": "mistral4",
    "olmo2": "olmo2",
    "olmo3": "olmo3",
    "smollm3": "smollm3",
    "glm4": "glm4",
    "glm4_moe": "glm4_moe",
    "glm4_moe_lite": "glm4_moe_lite",
    "solar_open": "solar_open",
    "ernie4_5": "ernie4_5",
    "ernie4_5_moe": "ernie4_5_moe",
    "granite": "granite",
    "granitemoe": "granitemoe",
    "granitemoeshared": "granitemoe",
    "granitemoehybrid": "granitemoehybrid",
    "cohere": "cohere",
    "cohere2": "cohere2",
    "seed_oss": "seed_oss",
    "exaone4": "exaone4",
    "hunyuan_v1_dense": "hunyuan_v1_dense",
    "qwen3_5": "qwen3_5",  # multimodal: its text_config's language model
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "llama4": "llama4",  # multimodal: its text_config's language model
    "llama4_text": "llama4",
    "minimax_m2": "minimax_m2",
}


def model_module(model_type: str) -> ModuleType:
    """The module for a config.json `model_type`; UnsupportedError lists the supported ones."""
    try:
        name = ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedError(
            f"architecture {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
    return importlib.import_module(f"llmrun.models.{name}")


def kv_cache_bytes(config: dict[str, Any], context: int, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache a model of this config.json-style dict keeps for `context`
    positions (bytes_per_value: the compute dtype's, 4 for f32): every layer's keys
    and values, sliding-window layers (Gemma 2/3) holding at most their window; of a
    hybrid model, its attention layers (`layer_windows()` has one entry per KV cache
    layer), not its recurrent state (recurrent_state_bytes).
    Imports the family's module, hence torch."""
    from llmrun.models.cache import cache_bytes

    module = model_module(config.get("model_type", "<missing model_type>"))
    args = module.ModelArgs.from_config(config)
    windows = (
        args.layer_windows() if hasattr(args, "layer_windows") else [None] * args.num_hidden_layers
    )
    # MLA families cache one head of a width of their own, the latent (deepseek_v2.ModelArgs).
    head_dim = getattr(args, "cache_head_dim", args.head_dim)
    shared = getattr(args, "cache_values_are_keys", False)  # MLA's latent: stored once
    return cache_bytes(
        args.num_key_value_heads, head_dim, windows, context, bytes_per_value, shared
    )


def recurrent_state_bytes(args: Any) -> int:
    """Bytes one sequence's recurrent state takes in a hybrid model (its ModelArgs'
    `recurrent_shapes()`, llmrun.models.recurrent; float32), 0 for other models."""
    if not hasattr(args, "recurrent_shapes"):
        return 0
    import torch

    from llmrun.models.recurrent import RecurrentState

    return RecurrentState.bytes_per_row(args.recurrent_shapes(), torch.float32)
