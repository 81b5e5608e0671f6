"""GLM-4 0414 GGUFs (arch "glm4") as llama.cpp's converter writes them
(conversion/glm.py Glm4Model). GLM-4 before 0414 (arch "chatglm") is chatglm.py's.

The converter keeps Hugging Face's q/k rows (GLM's RoPE rotates adjacent pairs, which
is llama.cpp's "normal" RoPE: nothing to undo), writes the fused gate_up_proj as
ffn_up, the norm after attention as post_attention_norm and the one after the MLP as
post_ffw_norm, and the rotated width as rope.dimension_count (llama.cpp: the head
size where absent). GLM-4.1V's and GLM-4.6V-Flash's text (Glm4vForConditionalGeneration)
is converted the same, with M-RoPE sections and the rotated q/k rows reordered into
halves for llama.cpp's M-RoPE (llmrun/loading/vl_text.py puts them back). GLM-OCR's
text (GlmOcrForConditionalGeneration) too, its NextN/MTP layer last (counted in
block_count and named by nextn_predict_layers), which llama.cpp's inference skips.
"""

from __future__ import annotations

from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError
from llmrun.loading import glm4_moe, vl_text
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "glm4"
# GGUF layer tensor -> HF module, where GLM-4 differs from the common names.
LAYER_NAMES = {
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """GLM-4's fields of the HF-style config that config_from_gguf built: the rotated
    share of each head (its ModelArgs default, 0.5, is not llama.cpp's), and the trunk's
    layers without the NextN prediction layers (GLM-OCR's), which llmrun skips as
    llama.cpp does. GLM-4.1V's text (M-RoPE sections, its q/k rows reordered:
    vl_text.gguf_weights) turns by the token's position in every section, as plain RoPE."""
    head_dim = config["head_dim"]
    layers, nextn = glm4_moe.trunk_layers(gg, ARCH)
    config["num_hidden_layers"] = layers
    config[glm4_moe.NEXTN] = nextn
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    if rotated % 2 or rotated > head_dim:
        raise ModelFormatError(
            f"{gg.path}: {ARCH}.rope.dimension_count is {rotated}, but RoPE rotates pairs "
            f"of the {head_dim} features of a head"
        )
    config["rope_parameters"]["partial_rotary_factor"] = rotated / head_dim
    sections = vl_text.text_mrope_sections(gg, ARCH, meta, rotated)
    if sections:
        config["rope_parameters"]["mrope_section"] = sections[:3]
