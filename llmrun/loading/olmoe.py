"""OLMoE at the loader edge: "olmoe" GGUFs as llama.cpp's converter writes them
(conversion/olmo.py OlmoeModel: TextModel's keys, the experts stacked as Qwen2-MoE's,
q/k rows as they are) and llama.cpp reads them (src/models/olmoe.cpp): NEOX RoPE over
whole heads, the q/k norms over whole projections, softmax gating with the top-k
weights never renormalized (its graph passes norm_w false and reads no key for it), the
experts feed_forward_length wide. Tensor names are gguf_config's mixture-of-experts ones.
"""

from __future__ import annotations

from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "olmoe"


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """The experts' fields of an "olmoe" GGUF's config (`config` holds the common ones).
    llama.cpp refuses a file without experts, and one
    whose heads are not hidden / heads wide or not rotated whole (GGML_ASSERTs)."""
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: olmoe.expert_used_count is {used} and olmoe.expert_count {count}; "
            "an OLMoE model routes each token to 1 to expert_count experts"
        )
    heads = config["num_attention_heads"]
    if config["head_dim"] != config["hidden_size"] // heads:
        raise UnsupportedError(
            f"{gg.path}: heads of {config['head_dim']} features in an embedding of "
            f"{config['hidden_size']} with {heads} heads; OLMoE's are embedding / heads wide"
        )
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise UnsupportedError(f"{gg.path}: OLMoE rotates whole heads (rope.dimension_count)")
    config.update(num_experts=count, num_experts_per_tok=used, norm_topk_prob=False)
