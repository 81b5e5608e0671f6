"""A.X K1 and K2 folders at the loader edge. Like DeepSeek's, their multi-token-prediction
layers past num_hidden_layers are dropped and FP8 checkpoints refused
(deepseek2.hf_weights); A.X K1's may also hold a post_mlp_layernorm in dense layers, which
transformers leaves unread (AXK1PreTrainedModel ignores it: the norm follows the expert
layers alone), and so does llmrun."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from llmrun.loading import deepseek2
from llmrun.models import axk1

K1, K2 = "axk1", "axk2"
MODEL_TYPES = (K1, K2)
_POST_MLP_NORM = re.compile(r"model\.layers\.(\d+)\.post_mlp_layernorm\.weight")


def hf_weights(weights: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    """`weights` without the MTP layers and, of A.X K1, the dense layers'
    post_mlp_layernorm."""
    weights = deepseek2.hf_weights(weights, config, path)
    if config.get("model_type") != K1:
        return weights
    args = axk1.ModelArgs.from_config(config)

    def unread(key: str) -> bool:
        match = _POST_MLP_NORM.fullmatch(key)
        return match is not None and not args.sparse(int(match.group(1)))

    return {k: w for k, w in weights.items() if not unread(k)}
