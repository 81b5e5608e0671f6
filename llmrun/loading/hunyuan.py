"""Hunyuan dense GGUFs (arch "hunyuan-dense") as llama.cpp's converter writes them
(conversion/hunyuan.py HunYuanModel: TextModel's keys, q/k rows as they are for its
NEOX RoPE, NTK-alpha RoPE written as the stretched base it comes to, with a 256K
context), read as src/models/hunyuan-vl.cpp reads them (llama_model_hunyuan_dense is
its subclass): a rope.scaling.alpha key, where a file has one, stretches the base as
the converter would have, and the q/k norms act after RoPE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import GGUFFile

ARCH = "hunyuan-dense"
MODEL_TYPE = "hunyuan_v1_dense"
# GGUF layer tensor -> HF module, where Hunyuan differs from the common names.
LAYER_NAMES = {
    "attn_q_norm": "self_attn.query_layernorm",
    "attn_k_norm": "self_attn.key_layernorm",
}


def finish_config(gg: GGUFFile, config: dict[str, Any], key: Callable[..., Any]) -> None:
    """Hunyuan's fields of the HF-style config that config_from_gguf built: the RoPE base
    stretched by rope.scaling.alpha where the file has one (llama_model_hunyuan_vl::
    load_arch_hparams). Refuses partial RoPE and M-RoPE sections (Hunyuan-VL's XD-RoPE),
    which llmrun's Hunyuan dense does not compute."""
    rope, head_dim = config["rope_parameters"], config["head_dim"]
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {_full(Keys.Rope.DIMENSION_COUNT)} is not the head size {head_dim}; "
            "Hunyuan rotates whole heads"
        )
    sections = key(_name(Keys.Rope.DIMENSION_SECTIONS))
    if sections and any(sections):
        raise UnsupportedError(
            f"{gg.path}: a {ARCH} file with M-RoPE sections (Hunyuan-VL's XD-RoPE) is not supported"
        )
    alpha = key(_name(Keys.Rope.SCALING_ALPHA), 0.0)
    if alpha > 0:
        rope["rope_theta"] *= alpha ** (head_dim / (head_dim - 2))


def _name(template: str) -> str:
    """A gguf.Keys "{arch}.NAME" template without its arch: the key() argument."""
    return template.removeprefix("{arch}.")


def _full(template: str) -> str:
    return template.format(arch=ARCH)
