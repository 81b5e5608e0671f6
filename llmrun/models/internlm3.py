"""InternLM3 (Shanghai AI Laboratory, InternLM3-8B-Instruct): Llama with Llama's module
names, whose config.json calls the attention's biases `qkv_bias` and the feed-forward's
`bias`, and InternLM2's dynamic NTK RoPE scaling, run as plain RoPE within
max_position_embeddings (llmrun/models/internlm2.py). llama.cpp's converter
(conversion/internlm.py InternLM3Model) writes it as a "llama" GGUF, which llmrun runs as
Llama.

Reference: transformers/models/internlm3 (InternLM3Config, run by LlamaForCausalLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import internlm2

# InternLM3Config.attribute_map: the checkpoints' field names -> Llama's.
CONFIG_ALIASES = {"qkv_bias": "attention_bias", "bias": "mlp_bias"}


@dataclass
class ModelArgs(internlm2.ModelArgs):
    # InternLM3Config's defaults where they differ from Llama's.
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        for alias, name in CONFIG_ALIASES.items():
            if alias in config:
                config.setdefault(name, config.pop(alias))
        if bool(config.get("attention_bias")) != bool(config.get("mlp_bias")):
            # The remote code's qkv_bias leaves o_proj to `bias`; transformers refuses them
            # unequal, and llmrun follows transformers.
            raise UnsupportedError(
                "an InternLM3 config with qkv_bias different from bias is not supported "
                "(transformers' InternLM3 refuses it too)"
            )
        return internlm2.with_plain_rope(cls, config)


# InternLM2's model: Llama's, refusing the positions dynamic NTK scaling would change.
Model = internlm2.Model
