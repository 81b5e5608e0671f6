"""GLM-5 (HF glm_moe_dsa; llama.cpp's GGUF arch "glm-dsa"): DeepSeek-V3.2's model
(multi-head latent attention, DeepSeek sparse attention, sigmoid-scored experts) with
GlmMoeDsaConfig's defaults and two differences in the indexer: its RoPE turns adjacent
pairs, and only the layers indexer_types calls "full" run one; a "shared" layer attends
to the keys the last full layer before it chose.

indexer_types, where a config.json lists none, comes as transformers derives it: from
index_topk_pattern ("F"/"S" per layer), else from index_topk_freq (default 1: every layer
full) and index_skip_topk_offset (default 2): layer i is full when max(i - offset + 1, 0)
is a multiple of the frequency.

Reference: transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmrun.errors import ModelFormatError
from llmrun.models import deepseek_v32

PATTERN_LETTERS = {"F": "full", "S": "shared"}


@dataclass
class ModelArgs(deepseek_v32.ModelArgs):
    # GlmMoeDsaConfig's defaults where they differ from DeepSeek-V3.2's.
    moe_intermediate_size: int = 2048
    intermediate_size: int = 12288
    n_group: int | None = 1
    topk_group: int | None = 1
    q_lora_rank: int | None = 2048
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    index_n_heads: int = 32
    # config.json's other ways of giving indexer_types (transformers' kwargs).
    index_topk_pattern: str | list[str] | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2

    def __post_init__(self) -> None:
        if self.indexer_types is None:
            self.indexer_types = derived_indexer_types(self)
        super().__post_init__()

    @property
    def indexer_rope_pairs(self) -> bool:
        return True


def derived_indexer_types(args: ModelArgs) -> list[str]:
    """indexer_types as transformers derives it where a config lists none (see the
    module docstring), from the args' index_topk_pattern, index_topk_freq and
    index_skip_topk_offset."""
    pattern = args.index_topk_pattern
    if pattern is None:
        freq, offset = max(args.index_topk_freq, 1), args.index_skip_topk_offset
        return [
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared"
            for i in range(args.num_hidden_layers)
        ]
    if isinstance(pattern, str):
        if not set(pattern) <= set(PATTERN_LETTERS):
            raise ModelFormatError(
                f"index_topk_pattern is {pattern!r}; it needs one of "
                f"{', '.join(PATTERN_LETTERS)} per layer"
            )
        pattern = [PATTERN_LETTERS[c] for c in pattern]
    return list(pattern)


class Model(deepseek_v32.Model):
    """DeepSeek-V3.2's model, under this family's name."""
