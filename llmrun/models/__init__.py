"""Registry: Hugging Face model_type -> the module that implements it.

Each module has `ModelArgs.from_config(config_dict)` and `Model(args)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from llmrun.errors import UnsupportedError

ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
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
