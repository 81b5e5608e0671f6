"""Llama 4 checkpoints: Hugging Face folders (the experts' fused tensors split into
llmrun's one module per expert) and GGUFs of arch "llama4" as llama.cpp's converter
writes them (conversion/llama.py Llama4Model: Hugging Face's q/k rows as they are,
since llama.cpp turns Llama 4's adjacent pairs with its "normal" RoPE; feed_forward_length
the dense layers' width and expert_feed_forward_length the experts'; the experts
stacked; Llama 3 RoPE scaling as a rope_freqs tensor), read as
src/models/llama4.cpp reads them. The converter writes nothing of the chunked
attention, the NoPE layers or the attention temperature: llama.cpp fixes them (chunks
of 8192, every fourth layer without RoPE, floor scale 8192, scale 0.1), and normalizes
queries and keys unless the model has 128 experts (Maverick).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = "llama4"
MODEL_TYPE = "llama4_text"
# llama_model_llama4::load_arch_hparams's fixed values for a file with chunked attention.
CHUNK_SIZE = 8192  # hparams.n_swa
FLOOR_SCALE = 8192  # n_attn_temp_floor_scale
ATTN_SCALE = 0.1  # f_attn_temp_scale
SWA_PATTERN = 4  # load_swa_pattern(ml, 4): three chunked layers, then a full one
NO_ROPE_STEP = 4  # hparams.n_no_rope_layer_step: every fourth layer without RoPE
UNNORMED_EXPERTS = 128  # use_kq_norm = type != LLM_TYPE_17B_128E


def _layer(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensor -> HF module, where Llama 4 differs from the common names.
LAYER_NAMES = {
    _layer(MODEL_TENSOR.FFN_GATE): "feed_forward.gate_proj",
    _layer(MODEL_TENSOR.FFN_UP): "feed_forward.up_proj",
    _layer(MODEL_TENSOR.FFN_DOWN): "feed_forward.down_proj",
    _layer(MODEL_TENSOR.FFN_GATE_INP): "feed_forward.router",
    _layer(MODEL_TENSOR.FFN_GATE_SHEXP): "feed_forward.shared_expert.gate_proj",
    _layer(MODEL_TENSOR.FFN_UP_SHEXP): "feed_forward.shared_expert.up_proj",
    _layer(MODEL_TENSOR.FFN_DOWN_SHEXP): "feed_forward.shared_expert.down_proj",
    # Stacked experts: a template of each expert's key (see gguf_config.hf_name).
    _layer(MODEL_TENSOR.FFN_GATE_EXP): "feed_forward.experts.{expert}.gate_proj",
    _layer(MODEL_TENSOR.FFN_UP_EXP): "feed_forward.experts.{expert}.up_proj",
    _layer(MODEL_TENSOR.FFN_DOWN_EXP): "feed_forward.experts.{expert}.down_proj",
}
_FUSED = re.compile(r"(.*\.feed_forward\.experts)\.(gate_up_proj|down_proj)")


def finish_config(
    gg: GGUFFile,
    config: dict[str, Any],
    meta: ArchMetadata,
    layer_types: Callable[..., list[str]],
) -> None:
    """Llama 4's fields of the HF-style config that config_from_gguf built
    (`layer_types` is gguf_config's reader of llama.cpp's window pattern), with llama.cpp's fixed values (it reads attention.sliding_window only to
    turn the chunks off with 0; any other value still gives chunks of 8192, as here).
    Refuses what llama.cpp runs otherwise than transformers would: no chunked attention
    (attention.sliding_window 0: llama.cpp then runs its last layer without RoPE),
    partial RoPE, a RoPE base of the chunked layers' own; and files without experts,
    which llama.cpp refuses."""
    layers = config["num_hidden_layers"]

    if meta.get(Keys.Attention.SLIDING_WINDOW) == 0:
        raise UnsupportedError(
            f"{gg.path}: a llama4 file without chunked attention ({meta.name(Keys.Attention.SLIDING_WINDOW)} "
            "0, as MobileLLM's) is not supported"
        )
    rope = config["rope_parameters"]
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{config['head_dim']}; Llama 4 rotates whole heads"
        )
    local_base = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if local_base is not None and local_base != rope["rope_theta"]:
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.Rope.FREQ_BASE_SWA)} ({local_base}) differs from "
            f"{meta.name(Keys.Rope.FREQ_BASE)} ({rope['rope_theta']}); Llama 4 has one RoPE base"
        )
    experts = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    if not experts:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_COUNT)} is missing or 0; a llama4 model has experts"
        )
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= experts:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {experts} (each token needs 1 to {experts} experts)"
        )
    step = meta.require(Keys.LLM.INTERLEAVE_MOE_LAYER_STEP)
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    config.pop("sliding_window", None)
    config.update(
        intermediate_size_mlp=config["intermediate_size"],
        intermediate_size=width,
        num_local_experts=experts,
        num_experts_per_tok=used,
        moe_layers=[i for i in range(layers) if step > 0 and (i + 1) % step == 0],
        use_qk_norm=experts != UNNORMED_EXPERTS,
        no_rope_layers=[int((i + 1) % NO_ROPE_STEP != 0) for i in range(layers)],
        attention_chunk_size=CHUNK_SIZE,
        layer_types=[
            "chunked_attention" if kind == "sliding_attention" else kind
            for kind in layer_types(gg, meta, layers, SWA_PATTERN)
        ],
        attn_temperature_tuning=True,
        floor_scale=FLOOR_SCALE,
        attn_scale=ATTN_SCALE,
    )


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A Llama 4 text checkpoint's weights ({key: Weight}) under llmrun's names: each
    layer's stacked experts (`feed_forward.experts.gate_up_proj` [E, hidden, 2 * width],
    gate columns then up columns, and `down_proj` [E, width, hidden], both multiplied
    from the left) as each expert's gate, up and down weights. `weight_type` is the
    loader's Weight."""
    hidden, width = config["hidden_size"], config["intermediate_size"]
    return experts.split_stacked(weights, _FUSED, hidden, width, weight_type, transposed=True)
