"""Zyphra Zamba's and Zamba2's Hugging Face checkpoints (model_type "zamba", "zamba2") at
the loader edge: a shared transformer block is one set of weights, kept under the first
hybrid layer that runs it (llmrun/models/zamba.py, zamba2.py). save_pretrained writes it
there alone; the Hub's folders may repeat it under every hybrid layer, copies this
drops. llama.cpp has no converter for either: folders only.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.models import model_module

MODEL_TYPES = ("zamba", "zamba2")
_SHARED = re.compile(r"model\.layers\.(\d+)\.shared_transf(?:ormer)?\.")


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """`weights` without the shared blocks' copies at hybrid layers other than the first
    to run each block (hybrid layer rank r runs block r % num_mem_blocks)."""
    args = model_module(config["model_type"]).ModelArgs.from_config(config)
    blocks = getattr(args, "num_mem_blocks", 1)
    owners = set(args.attention_layers[:blocks])

    def kept(name: str) -> bool:
        shared = _SHARED.match(name)
        return shared is None or int(shared.group(1)) in owners

    return {name: w for name, w in weights.items() if kept(name)}


def cache_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """Each KV cache layer's (key/value heads, head width): one per hybrid layer, heads
    2 * hidden_size / num_attention_heads wide (llmrun.loading.inspect)."""
    args = model_module(config["model_type"]).ModelArgs.from_config(config)
    return [(args.num_key_value_heads, args.head_dim)] * len(args.attention_layers)
