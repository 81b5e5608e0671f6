"""Google RecurrentGemma's Hugging Face checkpoints (model_type "recurrent_gemma"): their
tensors load under their own names (llmrun/models/recurrent_gemma.py); what `show` needs
of the config. llama.cpp has no converter for RecurrentGemma: folders only.
"""

from __future__ import annotations

from typing import Any

from llmrun.errors import LlmrunError

MODEL_TYPE = "recurrent_gemma"


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a recurrent_gemma config.json-style dict cache keys and values
    (block_types taken in turn), None for other models or a config that does not hold
    (llmrun.loading.inspect)."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    from llmrun.models.recurrent_gemma import ModelArgs

    try:
        return len(ModelArgs.from_config(config).attention_layers)
    except (LlmrunError, TypeError):
        return None
