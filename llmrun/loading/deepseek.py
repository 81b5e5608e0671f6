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

DeepSeek-OCR 2's (and DeepSeek-OCR's) language model, arch "deepseek2-ocr" (the converter's
DeepseekV2Model for DeepseekOCR2ForCausalLM; src/models/deepseek2ocr.cpp and the is_ocr
branch of deepseek2.cpp), is the same model under other conventions: q/k rows as HF has
them (NEOX RoPE over whole heads, whatever rope.dimension_count says; base 10000, which
llama.cpp asserts), experts scored by softmax unless expert_gating_func says otherwise,
renormalized where expert_weights_norm is set.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import bailingmoe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "deepseek", "deepseek"
OCR_ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.DEEPSEEK2OCR]


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


def finish_ocr_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """DeepSeek-OCR's language model's fields (arch deepseek2-ocr), read as
    llama_model_deepseek2ocr::load_arch_hparams and the deepseek2 graph's is_ocr branch
    read them (see the module docstring)."""
    path, arch = gg.path, gg.architecture
    bailingmoe.expert_fields(gg, config, meta)
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)
    if scale not in (0.0, 1.0):
        raise UnsupportedError(
            f"{path}: {arch}.expert_weights_scale is {scale}; llmrun runs unscaled weights"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, int(ExpertGatingFuncType.SOFTMAX))
    if gating not in (0, int(ExpertGatingFuncType.SOFTMAX)):  # 0: none, taken as softmax
        raise UnsupportedError(
            f"{path}: {arch}.expert_gating_func is {gating}; llmrun runs softmax scores"
        )
    base = config["rope_parameters"]["rope_theta"]
    if abs(base - 10000.0) > 1e-4:
        raise ModelFormatError(
            f"{path}: {arch}.rope.freq_base is {base}; llama.cpp runs this arch at 10000 only"
        )
    # llama.cpp turns whole heads whatever rope.dimension_count says (0 in the converter's).
    config["rope_parameters"].pop("partial_rotary_factor", None)
    # Unlimited-OCR's reference sliding window, which the converter writes (for this arch
    # only Unlimited-OCR's) and llama.cpp leaves unread: transformers attends through it.
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    if window:
        config["reference_window"] = int(window)
