"""Dory checkpoints at the loader edge: the Hub's folders (nvidia/NVIDIA-Nemotron-Labs-
Dory1.0-4B-BF16) and transformers' save_pretrained ones, renamed to transformers' module
names as its conversion_mapping.py does ("dory": LayerPairCollapse and renames).

Both keep the model under backbone. (embeddings: the token embeddings, self_attn.g_proj:
the attention's output gate). The Hub's folders also store each decoder layer as two
blocks, layers.{2i}.mixer (the attention) and layers.{2i+1}.mixer (the MLP), with the
residual rates as attn_alpha and mlp_alpha: layer i's self_attn, mlp, lambda_1 and
lambda_2. The config's block counts are llmrun.models.dory_config's to read. llama.cpp
has no converter for Dory: folders only.
"""

from __future__ import annotations

import re
from typing import Any

MODEL_TYPE = "dory"
_BLOCK = re.compile(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")
_ALPHAS = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}
_RENAMES = (
    (re.compile(r"^backbone\."), "model."),
    (re.compile(r"\.embeddings\."), ".embed_tokens."),
    (re.compile(r"\.self_attn\.g_proj\."), ".self_attn.gate_proj."),
)


def hf_name(name: str) -> str:
    """A checkpoint key under llmrun's (transformers') name."""
    block = _BLOCK.search(name)
    if block is not None:
        index, part = int(block[1]), block[2]
        part = _ALPHAS.get(part, ("self_attn", "mlp")[index % 2])
        name = f"{name[: block.start()]}layers.{index // 2}.{part}{name[block.end() :]}"
    for pattern, new in _RENAMES:
        name = pattern.sub(new, name)
    return name


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Dory folder's weights under transformers' names."""
    return {hf_name(name): w for name, w in weights.items()}
