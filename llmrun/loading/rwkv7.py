"""RWKV-7 at the loader edge: "rwkv7" GGUFs as llama.cpp's converter writes them from
fla-hub's RWKV7ForCausalLM folders (conversion/rwkv.py Rwkv7Model) and llama.cpp reads them
(src/models/rwkv7.cpp, rwkv7-base.cpp), under fla's names (llmrun/models/rwkv7.py).

What the converter does, undone here: the six token-shift mixes x_r, x_w, x_k, x_v, x_a,
x_g are stacked into one time_mix_lerp_fused [6, 1, 1, hidden]; r_k [heads, head_size] is
flattened; each LoRA is stored as its two matrices (w1, w2) and its bias (w0); the first
block, which has no v-first LoRA, is given copies of its a LoRA as v0, v1, v2 (llama.cpp
reads and never uses them; they are dropped here); pre_norm is token_embd_norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, layer_name, mapped_name

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "rwkv7"
MODEL_TYPE = "rwkv7"
# The order of the converter's stack of token-shift mixes (its lerp_list).
LERP_ORDER = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
_FUSED = "attn.lerp_fused"

GLOBAL_NAMES = {
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight": "model.embeddings.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD_NORM]}.weight": "model.layers.0.pre_norm.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD_NORM]}.bias": "model.layers.0.pre_norm.bias",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]}.weight": "model.norm.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]}.bias": "model.norm.bias",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight": "lm_head.weight",
}
_LORAS = {"W": "w_lora", "A": "a_lora", "V": "v_lora", "G": "g_lora"}
# GGUF tensor (after "blk.N.", with its suffix) -> fla key (after "model.layers.N.").
LAYER_NAMES = {
    f"{layer_name(MODEL_TENSOR.ATTN_NORM)}.weight": "attn_norm.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_NORM)}.bias": "attn_norm.bias",
    f"{layer_name(MODEL_TENSOR.ATTN_NORM_2)}.weight": "ffn_norm.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_NORM_2)}.bias": "ffn_norm.bias",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_LERP_FUSED)}.weight": _FUSED,
    f"{layer_name(MODEL_TENSOR.TIME_MIX_K_K)}.weight": "attn.k_k",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_K_A)}.weight": "attn.k_a",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_R_K)}.weight": "attn.r_k",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_RECEPTANCE)}.weight": "attn.r_proj.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_KEY)}.weight": "attn.k_proj.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_VALUE)}.weight": "attn.v_proj.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_OUTPUT)}.weight": "attn.o_proj.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_LN)}.weight": "attn.g_norm.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_LN)}.bias": "attn.g_norm.bias",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_LERP_K)}.weight": "ffn.x_k",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_KEY)}.weight": "ffn.key.weight",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_VALUE)}.weight": "ffn.value.weight",
}
for _letter, _lora in _LORAS.items():
    _parts = {"0": "lora.2.bias", "1": "lora.0.weight", "2": "lora.2.weight"}
    for _index, _part in _parts.items():
        if _letter == "G" and _index == "0":
            continue  # the gate's LoRA has no bias
        _tensor = MODEL_TENSOR[f"TIME_MIX_{_letter}{_index}"]
        LAYER_NAMES[f"{layer_name(_tensor)}.weight"] = f"attn.{_lora}.{_part}"


def hf_name(gguf_name: str) -> str | None:
    """The fla key of an "rwkv7" GGUF tensor (the fused token-shift mixes under a name of
    their own, split by gguf_weights), or None if it has none."""
    return mapped_name(gguf_name, GLOBAL_NAMES, LAYER_NAMES, "model.layers.")


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The fla config.json dict of an "rwkv7" GGUF, read as llama_model_rwkv7 reads it."""
    meta = ArchMetadata.of(gg, ARCH)
    embed = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    if embed is None:
        raise ModelFormatError(f"{gg.path}: tensor token_embd.weight is missing")
    gate = meta.get(Keys.Attention.GATE_LORA_RANK, 0)
    if not gate:
        raise ModelFormatError(f"{gg.path}: an RWKV-7 without its output gate (gate_lora_rank 0)")
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "head_dim": meta.require(Keys.WKV.HEAD_SIZE),
        "decay_low_rank_dim": meta.require(Keys.Attention.DECAY_LORA_RANK),
        "a_low_rank_dim": meta.require(Keys.Attention.ICLR_LORA_RANK),
        "v_low_rank_dim": meta.require(Keys.Attention.VALUE_RESIDUAL_MIX_LORA_RANK),
        "gate_low_rank_dim": gate,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": False,
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """An "rwkv7" GGUF's tensors as the model holds them: the token-shift mixes apart,
    r_k per head, the first block's unused v LoRA dropped; `weight_type` wraps a tensor
    (loader.Weight)."""
    hidden, head = config["hidden_size"], config["head_dim"]
    out = {}
    for name, w in weights.items():
        if name.startswith("model.layers.0.attn.v_lora."):
            continue
        small = name.endswith((_FUSED, "attn.r_k", "attn.k_k", "attn.k_a", "ffn.x_k"))
        if small and w.ggml_type is not None:
            raise ModelFormatError(
                f"tensor {name} is quantized ({w.ggml_type.name}); llama.cpp keeps RWKV-7's "
                "token-shift mixes and key factors in float"
            )
        if name.endswith(_FUSED):
            mixes = w.tensor.reshape(len(LERP_ORDER), hidden)
            block = name.removesuffix(_FUSED)
            for i, mix in enumerate(LERP_ORDER):
                out[f"{block}attn.{mix}"] = weight_type(
                    mixes[i].view(1, 1, hidden), None, (1, 1, hidden)
                )
            continue
        if name.endswith("attn.r_k"):
            w = weight_type(w.tensor.reshape(hidden // head, head), None, (hidden // head, head))
        out[name] = w
    return out
