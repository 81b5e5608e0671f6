"""dots.llm1 (rednote-hilab dots.llm1.base and .inst; llama.cpp's "dots1" GGUFs): Qwen3's
attention (an RMSNorm on each query and key head before RoPE, which turns halves) with
GLM-4.5 MoE's feed-forward, DeepSeek-V3's: first_k_dense_replace dense layers, then
experts chosen by sigmoid score + e_score_correction_bias among the topk_group best of
n_group groups, weighted by the unbiased scores (renormalized with norm_topk_prob)
times routed_scaling_factor, plus n_shared_experts shared experts.

transformers makes the layers from max_window_layers on sliding-window layers where a
config has a sliding_window (layer_types); the released configs have none, llama.cpp
has no such layers, and llmrun refuses them.

Reference: transformers/models/dots1/modeling_dots1.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import deepseek_v3, glm4_moe, qwen3
from llmrun.models.base import CausalLM, GatedMLP, check_layer_types

# Dots1Config's: where a config leaves them out, layers from the 62nd on slide.
DEFAULT_WINDOW, DEFAULT_WINDOW_LAYERS = 4096, 62


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    # Dots1Config's defaults where they differ from GLM-4.5 MoE's.
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    layer_types: list[str] = field(default_factory=list)
    # Every head's q/k norms, RoPE on the whole head.
    use_qk_norm: bool = True
    default_partial_rotary_factor = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        kinds = check_layer_types(self.layer_types, self.num_hidden_layers)
        if "sliding_attention" in kinds:
            raise UnsupportedError(
                "dots.llm1 with sliding-window layers (layer_types, or a sliding_window and "
                "max_window_layers under num_hidden_layers) is not supported"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # Whatever use_qk_norm a file says: dots.llm1 always normalizes.
        config = {**config, "use_qk_norm": True}
        if not config.get("layer_types"):  # as Dots1Config builds them
            window = config.get("sliding_window", DEFAULT_WINDOW)
            first = config.get("max_window_layers")
            first = DEFAULT_WINDOW_LAYERS if first is None else first
            config["layer_types"] = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(config.get("num_hidden_layers", 0))
            ]
        return super().from_config(config)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, qwen3.Attention, GatedMLP, deepseek_v3.Layer)
