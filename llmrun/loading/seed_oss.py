"""Seed-OSS GGUFs (arch "seed_oss") as llama.cpp's converter writes them
(conversion/olmo.py SeedOssModel: TextModel's keys, Hugging Face's q/k rows as they
are, since llama.cpp rotates Seed-OSS with NEOX RoPE), and read as
src/models/seed-oss.cpp reads them: the norm before the feed-forward is stored as
post_attention_norm, the q/k/v biases are there when the model has them, and RoPE turns
whole heads.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "seed_oss"
# GGUF layer tensor -> HF module, where Seed-OSS differs from the common names.
LAYER_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.ATTN_POST_NORM].split(".")[-1]: "post_attention_layernorm",
}


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Seed-OSS's fields of the HF-style config that config_from_gguf built: the output
    projection's bias where the file has one (SeedOssConfig's attention_out_bias).
    Refuses partial RoPE, which llama.cpp's graph asserts away."""
    config["attention_out_bias"] = "blk.0.attn_output.bias" in gg.tensors
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} is not the head size "
            f"{config['head_dim']}; Seed-OSS rotates whole heads"
        )
