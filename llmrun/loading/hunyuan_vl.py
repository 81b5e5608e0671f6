"""HunYuan-VL's language model GGUFs (arch "hunyuan_vl": HunyuanOCR) as llama.cpp's
converter writes them (conversion/hunyuan.py HunyuanVLTextModel: Hunyuan dense's keys and
tensors, q/k rows as they are, the output matrix left out where tied; for XD-RoPE the
unstretched base with rope.scaling.alpha, the context length as the config's, and the
XD-RoPE sections as rope.dimension_sections), read as src/models/hunyuan-vl.cpp reads
them: the base stretched by alpha^(head_dim / (head_dim - 2)) where alpha is set, whole
heads rotated, and M-RoPE over the sections, which a text token's position fills in the
first three and 0 in the fourth (llama-graph.cpp). transformers turns a text token by its
position on every axis: plain RoPE, which llmrun computes whatever the sections. Where the
fourth section holds pairs (HunyuanOCR's [16, 16, 16, 16]) llama.cpp turns those by 0
instead; llmrun follows the reference there rather than refuse the model's own files
(unlike vl_text.text_mrope_sections for Qwen2-VL and GLM-4V, whose converters leave the
fourth section empty). The sections become the config's mrope_section, by which prompts
with images turn (llmrun.models.hunyuan_v1_dense).
"""

from __future__ import annotations

from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError
from llmrun.loading import hunyuan
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = "hunyuan_vl"
MODEL_TYPE = hunyuan.MODEL_TYPE  # its text is Hunyuan dense's


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """HunYuan-VL's fields of the HF-style config that config_from_gguf built: whole-head
    RoPE (its graph asserts n_rot == the head size), sections whose text RoPE is plain,
    and the base stretched by rope.scaling.alpha (llama_model_hunyuan_vl::
    load_arch_hparams)."""
    head_dim = config["head_dim"]
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise ModelFormatError(
            f"{gg.path}: {ARCH}.rope.dimension_count is not the head size {head_dim}; "
            "llama.cpp's HunYuan-VL rotates whole heads"
        )
    sections = _check_sections(gg, meta, head_dim)
    if sections:  # the XD-RoPE of prompts with images (llmrun.models.hunyuan_v1_dense)
        config["rope_parameters"]["mrope_section"] = sections
    alpha = meta.get(Keys.Rope.SCALING_ALPHA, 0.0)
    if alpha > 0:
        config["rope_parameters"]["rope_theta"] *= alpha ** (head_dim / (head_dim - 2))


def _check_sections(gg: GGUFFile, meta: ArchMetadata, head_dim: int) -> list[int] | None:
    """rope.dimension_sections, where present: at most four sizes (llama.cpp loads four
    only; the converter writes three for a three-axis config), none negative, covering no
    more than the head's pairs (ggml asserts it)."""
    sections = meta.get(Keys.Rope.DIMENSION_SECTIONS)
    if sections is None:
        return None
    name = Keys.Rope.DIMENSION_SECTIONS.format(arch=ARCH)
    listed = isinstance(sections, list) and len(sections) <= 4
    if not listed or any(not isinstance(s, int) or s < 0 for s in sections):
        raise ModelFormatError(f"{gg.path}: {name} is {sections!r}; llama.cpp reads four sizes")
    if sum(sections) > head_dim // 2:
        raise ModelFormatError(
            f"{gg.path}: {name} {sections} covers {sum(sections)} pairs; a head of "
            f"{head_dim} has {head_dim // 2}"
        )
    return list(sections)
