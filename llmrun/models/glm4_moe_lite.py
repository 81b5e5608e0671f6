"""GLM-4.7-Flash (HF glm4_moe_lite): DeepSeek-V3's model (multi-head latent attention,
sigmoid-scored experts chosen with e_score_correction_bias, shared experts) with
Glm4MoeLiteConfig's defaults, and the dense layers named by mlp_layer_types (default:
the first one) rather than first_k_dense_replace, which transformers ignores here.
llama.cpp converts it to a "deepseek2" GGUF (llmrun/loading/deepseek2.py).

The Hub's checkpoints hold num_nextn_predict_layers multi-token-prediction layers past
num_hidden_layers; transformers ignores them, and so does llmrun.

Reference: transformers/models/glm4_moe_lite/modeling_glm4_moe_lite.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v3

LAYER_KINDS = ("dense", "sparse")


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    # Glm4MoeLiteConfig's defaults where they differ from DeepSeek-V3's.
    intermediate_size: int = 10240
    moe_intermediate_size: int = 1536
    n_routed_experts: int = 64
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 1.8
    n_group: int | None = 1
    topk_group: int | None = 1
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 768
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752
    mlp_layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        kinds = self.mlp_layer_types or ["dense"] + ["sparse"] * (self.num_hidden_layers - 1)
        if len(kinds) != self.num_hidden_layers or not set(kinds) <= set(LAYER_KINDS):
            raise ModelFormatError(
                f"mlp_layer_types is {kinds!r}; it needs {self.num_hidden_layers} entries of "
                f"{' or '.join(LAYER_KINDS)}"
            )
        dense = kinds.index("sparse") if "sparse" in kinds else len(kinds)
        if "dense" in kinds[dense:]:
            raise UnsupportedError(
                "GLM-4.7-Flash with dense layers after expert layers (mlp_layer_types) is "
                "not supported"
            )
        self.mlp_layer_types, self.first_k_dense_replace = kinds, dense
        super().__post_init__()


class Model(deepseek_v3.Model):
    """DeepSeek-V3's model, under this family's name."""
