"""Jamba at the loader edge: "jamba" GGUFs as llama.cpp's converter writes them
(conversion/jamba.py JambaModel) and llama.cpp reads them (src/models/jamba.cpp), and
transformers 5's stacked experts.

What the converter does, undone here: head_count_kv is written per layer, 0 for a Mamba
layer (llama.cpp's is_recr), so the layer pattern comes from it; a layer has experts
where its router (ffn_gate_inp) is in the file; the experts are stacked; A_log is stored
as A = -exp(A_log) and the convolution [inner, 1, K] as [inner, K] (mamba.gguf_weights
undoes both); q/k are not permuted (no RoPE). llama.cpp's experts: the router's softmax,
the top expert_used_count, not renormalized (Jamba's own routing).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, mamba
from llmrun.loading.gguf_io import ArchMetadata, layer_name

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH, MODEL_TYPE = "jamba", "jamba"


GLOBAL_NAMES = {
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight": "model.embed_tokens.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]}.weight": "model.final_layernorm.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight": "lm_head.weight",
}
# GGUF tensor (after "blk.N.", with its suffix) -> HF key (after "model.layers.N.").
LAYER_NAMES = {
    f"{layer_name(MODEL_TENSOR.ATTN_NORM)}.weight": "input_layernorm.weight",
    f"{layer_name(MODEL_TENSOR.FFN_NORM)}.weight": "pre_ff_layernorm.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_Q)}.weight": "self_attn.q_proj.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_K)}.weight": "self_attn.k_proj.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_V)}.weight": "self_attn.v_proj.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_OUT)}.weight": "self_attn.o_proj.weight",
    f"{layer_name(MODEL_TENSOR.SSM_DT_NORM)}.weight": "mamba.dt_layernorm.weight",
    f"{layer_name(MODEL_TENSOR.SSM_B_NORM)}.weight": "mamba.b_layernorm.weight",
    f"{layer_name(MODEL_TENSOR.SSM_C_NORM)}.weight": "mamba.c_layernorm.weight",
    f"{layer_name(MODEL_TENSOR.FFN_GATE)}.weight": "feed_forward.gate_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_UP)}.weight": "feed_forward.up_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_DOWN)}.weight": "feed_forward.down_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_GATE_INP)}.weight": "feed_forward.router.weight",
    # Each expert's key, with an {expert} field: the loader splits the stacks.
    f"{layer_name(MODEL_TENSOR.FFN_GATE_EXP)}.weight": "feed_forward.experts.{expert}.gate_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_UP_EXP)}.weight": "feed_forward.experts.{expert}.up_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_DOWN_EXP)}.weight": "feed_forward.experts.{expert}.down_proj.weight",
    # The Mamba mixer's, as the "mamba" arch names them.
    **{
        gguf: f"mamba.{hf.removeprefix('mixer.')}"
        for gguf, hf in mamba.LAYER_NAMES.items()
        if hf.startswith("mixer.")
    },
}
# transformers 5's stacks of a layer's experts.
_STACKED = re.compile(r"(model\.layers\.\d+\.feed_forward\.experts)\.(gate_up_proj|down_proj)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face key of a "jamba" GGUF tensor, or None if it has none."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    name = LAYER_NAMES.get(parts[2])
    return None if name is None else f"model.layers.{parts[1]}.{name}"


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The HF config.json dict of a "jamba" GGUF, read as llama_model_jamba reads it."""
    meta = ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    kv = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    kv_list = kv if isinstance(kv, list) else [kv] * layers
    if len(kv_list) != layers:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Attention.HEAD_COUNT_KV.format(arch=ARCH)} lists "
            f"{len(kv_list)} layers, but the model has {layers}"
        )
    attending = {n for n in kv_list if n}
    if (
        len(attending) > 1
        or isinstance(heads, list)
        or isinstance(meta.get(Keys.LLM.FEED_FORWARD_LENGTH), list)
    ):
        raise UnsupportedError(
            f"{gg.path}: per-layer head counts or feed-forward widths ({kv}); llmrun runs "
            "Jamba with one value for every attention layer"
        )
    inner = meta.require(Keys.SSM.INNER_SIZE)
    if inner % hidden:
        raise ModelFormatError(
            f"{gg.path}: ssm.inner_size {inner} is not a multiple of the embedding length {hidden}"
        )
    embed = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    if embed is None:
        raise ModelFormatError(f"{gg.path}: tensor token_embd.weight is missing")
    router = f"{layer_name(MODEL_TENSOR.FFN_GATE_INP)}.weight"
    expert_layers = [i for i in range(layers) if f"blk.{i}.{router}" in gg.tensors]
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if expert_layers and not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=ARCH)} is {used}, but "
            f"{Keys.LLM.EXPERT_COUNT.format(arch=ARCH)} is {count}"
        )
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": attending.pop() if attending else heads,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight" not in gg.tensors,
        "layer_types": ["attention" if n else "mamba" for n in kv_list],
        "expert_layers": expert_layers,
        "num_experts": count if expert_layers else 1,
        "num_experts_per_tok": used,
        "mamba_expand": inner // hidden,
        "mamba_d_state": meta.require(Keys.SSM.STATE_SIZE),
        "mamba_d_conv": meta.require(Keys.SSM.CONV_KERNEL),
        "mamba_dt_rank": meta.require(Keys.SSM.TIME_STEP_RANK),
        "mamba_conv_bias": True,  # llama.cpp requires the convolution's bias
        "mamba_proj_bias": False,  # and reads none of in_proj or out_proj
    }


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict[str, Any]:
    """A "jamba" GGUF's Mamba tensors as the model holds them (mamba.gguf_weights)."""
    renamed = {_as_mamba(name): w for name, w in weights.items()}
    held = mamba.gguf_weights(renamed, weight_type)
    return {_as_jamba(name): w for name, w in held.items()}


def _as_mamba(name: str) -> str:
    return name.replace(".mamba.", ".mixer.")


def _as_jamba(name: str) -> str:
    return name.replace(".mixer.", ".mamba.")


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """transformers 5's stacked experts (feed_forward.experts.gate_up_proj [E, 2 * width,
    hidden], down_proj) as one module's weights per expert."""
    return experts.split_stacked(
        weights, _STACKED, config["hidden_size"], config["intermediate_size"], weight_type
    )


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many of a jamba config's layers attend (and so have a KV cache), None for
    another config."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layer_types")
    if kinds is not None:
        return sum(kind == "attention" for kind in kinds)
    period, offset = config.get("attn_layer_period", 8), config.get("attn_layer_offset", 4)
    return sum(i % period == offset for i in range(int(config["num_hidden_layers"])))
