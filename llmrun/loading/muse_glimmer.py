"""Muse Glimmer GGUFs (arch "muse-glimmer", a name the installed gguf package may not
know yet) as llama.cpp's converter writes them (conversion/muse_glimmer.py
MuseGlimmerModel), read as src/models/muse-glimmer.cpp reads them:

- q/k rows permuted per head as Llama's (the loader undoes it: QK_PERMUTED_ARCHS);
- the four layer norms stored as 1 + w (the final norm as it is);
- qk_scale_factor folded into synthesized q/k norm weights (the query's all the factor,
  the key's all ones), read back here and refused where they are anything else;
- final_logit_softcapping (30 where absent, llama.cpp's default) and logit_scale
  (output_multiplier); the window and its per-layer pattern (default every fourth layer
  global); llama.cpp rotates the sliding layers alone, by rope.freq_base_swa where given,
  and takes the post-sublayer norms' epsilon as 1e-8 whatever the config said.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = "muse-glimmer"
MODEL_TYPE = "muse_glimmer_text"
SWA_PATTERN = 4  # load_swa_pattern(ml, 4)
POST_NORM_EPS = 1e-8  # muse-glimmer.cpp's post_norm_eps, which it reads no key for
SOFTCAP_DEFAULT = 30.0  # llama_hparams' f_final_logit_softcapping


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensor -> the HF module in the layer, where Muse Glimmer differs from the
# common names (attn_norm, attn_q/k/v, attn_output, attn_q_norm/k_norm, ffn_*).
LAYER_NAMES = {
    _short(MODEL_TENSOR.ATTN_POST_NORM): "post_attention_layernorm",
    _short(MODEL_TENSOR.FFN_PRE_NORM): "pre_feedforward_layernorm",
    _short(MODEL_TENSOR.FFN_POST_NORM): "post_feedforward_layernorm",
    _short(MODEL_TENSOR.ATTN_GATE): "self_attn.gate_proj",
}
_SHIFTED = "layernorm.weight"  # the four layer norms' names end so; model.norm's not


def finish_config(
    gg: GGUFFile,
    config: dict[str, Any],
    meta: ArchMetadata,
    layer_types: Callable[..., list[str]],
) -> None:
    """Muse Glimmer's fields of the HF-style config that config_from_gguf built, as
    llama_model_muse_glimmer::load_arch_hparams reads them (`layer_types` is gguf_config's
    reader of llama.cpp's window pattern). qk_scale_factor comes from the tensors
    (gguf_weights)."""
    layers = config["num_hidden_layers"]
    local = layer_types(gg, meta, layers, SWA_PATTERN)
    theta = meta.get(Keys.Rope.FREQ_BASE_SWA, config["rope_parameters"]["rope_theta"])
    config["rope_parameters"]["rope_theta"] = theta  # the rotating (sliding) layers' base
    config.update(
        sliding_window=meta.require(Keys.Attention.SLIDING_WINDOW),
        layer_types=local,
        layer_rope_theta=[theta if kind == "sliding_attention" else 0 for kind in local],
        final_logit_softcapping=meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, SOFTCAP_DEFAULT),
        output_multiplier=meta.require(Keys.LLM.LOGIT_SCALE),
        post_norm_eps=POST_NORM_EPS,
        hidden_activation="silu",
    )


def gguf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight: type, path: Path
) -> dict[str, Any]:
    """The model's weights from the GGUF `path`'s: the layer norms back to w, and the q/k
    norm weights turned back into config["qk_scale_factor"]; refuses norms that are not
    the converter's constant ones, which no weightless norm can run."""
    out, scales = {}, set()
    for name, w in weights.items():
        norm = name.endswith(_SHIFTED)
        qk_norm = name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))
        if not (norm or qk_norm):
            out[name] = w
            continue
        if w.ggml_type is not None:
            raise ModelFormatError(f"{path}: {name} is quantized; norm weights never are")
        if norm:
            out[name] = weight(w.tensor.float() - 1.0)
            continue
        values = w.tensor.float().unique()
        is_key = name.endswith("k_norm.weight")
        if values.numel() != 1 or (is_key and float(values) != 1.0):
            raise UnsupportedError(
                f"{path}: {name}: Muse Glimmer's q/k norms have no weights of their own "
                "(llama.cpp's converter writes the query's as qk_scale_factor throughout, "
                "the key's as ones); this file's differ"
            )
        if not is_key:
            scales.add(float(values))
    if len(scales) != 1:
        raise UnsupportedError(
            f"{path}: Muse Glimmer's qk_scale_factor differs between layers ({sorted(scales)}) "
            "or is missing"
        )
    config["qk_scale_factor"] = scales.pop()
    return out
