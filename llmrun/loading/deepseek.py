"""DeepSeek V1 MoE GGUFs (arch "deepseek": deepseek-moe-16b) as llama.cpp's converter
writes them (conversion/deepseek.py DeepseekModel) and llama.cpp reads them
(src/models/deepseek.cpp), as the config of llmrun.models.deepseek.

The converter permutes the q/k rows as a Llama's (undone by the loader:
gguf_config.QK_PERMUTED_ARCHS), stacks the experts and writes the rotated width (the
whole head), leading_dense_block_count, expert_feed_forward_length, expert_shared_count
and expert_weights_scale 1.0; the tensor names are Ling 1's (llmrun.loading.bailingmoe).
llama.cpp scores experts by softmax and never renormalizes their weights (it writes no
norm_topk_prob: a model trained with it runs unrenormalized in llama.cpp, and so here).
What it computes otherwise than the published code is refused: scaled weights, RoPE on
part of each head.
"""

from __future__ import annotations

from typing import Any

from gguf import Keys

from llmrun.errors import UnsupportedError
from llmrun.loading import bailingmoe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "deepseek", "deepseek"


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """DeepSeek V1's fields of the HF-style config that config_from_gguf built, read as
    llama_model_deepseek::load_arch_hparams reads them (see the module docstring)."""
    path, arch = gg.path, gg.architecture
    bailingmoe.expert_fields(gg, config, meta)
    config["norm_topk_prob"] = False
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)
    if scale not in (0.0, 1.0):
        raise UnsupportedError(
            f"{path}: {arch}.expert_weights_scale is {scale}; DeepSeek V1's expert weights "
            "are not scaled"
        )
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    if rotated != head_dim:
        raise UnsupportedError(
            f"{path}: {arch}.rope.dimension_count is {rotated}, but DeepSeek V1 turns whole "
            f"heads of {head_dim}"
        )
