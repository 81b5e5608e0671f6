"""GLM-4 GGUFs of arch "chatglm" as llama.cpp's converter writes them (conversion/chatglm.py
ChatGLMModel, for GlmForCausalLM and for the original ChatGLMModel checkpoints: GLM-4-9B,
ChatGLM3-6B) and src/models/chatglm.cpp reads them, run as transformers' GlmForCausalLM
(llmrun/models/glm.py).

The converter keeps the q/k rows as they are (llama.cpp's "normal" RoPE rotates GLM's
adjacent pairs), writes the fused gate_up rows as ffn_up, the rotated width as
rope.dimension_count (half of each head) and the RoPE base as 10000 * rope_ratio. The
original checkpoints' fused query_key_value (and its bias) becomes attn_qkv: q, k and v
rows one after the other, split here. llama.cpp reads no other key of the family.
"""

from __future__ import annotations

from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "chatglm", "glm"
# GGUF layer tensor -> HF module, where GLM differs from the common names.
LAYER_NAMES = {"ffn_up": "mlp.gate_up_proj"}
FUSED = "self_attn.qkv_proj"  # gguf_config's HF name of attn_qkv


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """GLM's fields of the HF-style config that config_from_gguf built: the rotated share
    of each head (llama.cpp's n_rot: the head size where the key is absent; GlmConfig's
    default 0.5 is not llama.cpp's) and the q/k/v biases, fused or not."""
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    if rotated % 2 or rotated > head_dim:
        raise ModelFormatError(
            f"{gg.path}: {ARCH}.rope.dimension_count is {rotated}, but RoPE rotates pairs "
            f"of the {head_dim} features of a head"
        )
    config["rope_parameters"]["partial_rotary_factor"] = rotated / head_dim
    config["attention_bias"] = any(
        f"blk.0.{name}.bias" in gg.tensors for name in ("attn_q", "attn_qkv")
    )


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A chatglm GGUF's tensors as the model holds them: a fused attn_qkv weight or bias
    split into q_proj, k_proj and v_proj rows (views of the file's). `weight_type` wraps a
    tensor (loader.Weight)."""
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    out = {}
    for key, w in weights.items():
        if f".{FUSED}." not in key:
            out[key] = w
            continue
        if w.shape[0] != q_rows + 2 * kv_rows:
            raise ModelFormatError(
                f"tensor {key} (attn_qkv) has {w.shape[0]} rows, but the heads make "
                f"{q_rows} query rows and {kv_rows} key and value rows each"
            )
        start = 0
        for part, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            piece = w.tensor.narrow(0, start, rows)
            shape = (rows, *w.shape[1:])
            out[key.replace(FUSED, f"self_attn.{part}")] = weight_type(piece, w.ggml_type, shape)
            start += rows
    return out
