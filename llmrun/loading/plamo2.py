"""PLaMo 2 at the loader edge: the Hub's folders (Plamo2ForCausalLM), and "plamo2" GGUFs as
llama.cpp's converter writes them (conversion/plamo.py Plamo2Model) and llama.cpp reads
them (src/models/plamo2.cpp).

The folders' layers are "model.layers.layers.N.", llmrun's "model.layers.N.". The
converter adds each norm's offset to its weight (OFFSETS), stores A_log as A = -exp(A_log), squeezes the convolution to [inner, d_conv] and
writes dt_bias as ssm_dt.bias, all undone here; it marks the Mamba layers by a KV head
count of 0 (attention.head_count_kv a list a layer), which llama.cpp reads as they are.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, layer_name, mapped_name, vocab_size

ARCH = MODEL_TYPE = "plamo2"
_HUB_LAYERS = "model.layers.layers."

GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight": "model.embed_tokens.weight",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM] + ".weight": "model.norm.weight",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight": "lm_head.weight",
}
# GGUF name after "blk.N." -> llmrun's after "model.layers.N.".
LAYER_NAMES = {
    layer_name(MODEL_TENSOR.ATTN_NORM) + ".weight": "pre_mixer_norm.weight",
    layer_name(MODEL_TENSOR.ATTN_POST_NORM): "post_mixer_norm.weight",
    layer_name(MODEL_TENSOR.FFN_NORM) + ".weight": "pre_mlp_norm.weight",
    layer_name(MODEL_TENSOR.FFN_POST_NORM): "post_mlp_norm.weight",
    layer_name(MODEL_TENSOR.FFN_UP) + ".weight": "mlp.gate_up_proj.weight",
    layer_name(MODEL_TENSOR.FFN_DOWN) + ".weight": "mlp.down_proj.weight",
    layer_name(MODEL_TENSOR.ATTN_QKV) + ".weight": "mixer.qkv_proj.weight",
    layer_name(MODEL_TENSOR.ATTN_Q_NORM) + ".weight": "mixer.q_weight",
    layer_name(MODEL_TENSOR.ATTN_K_NORM) + ".weight": "mixer.k_weight",
    layer_name(MODEL_TENSOR.ATTN_OUT) + ".weight": "mixer.o_proj.weight",
    layer_name(MODEL_TENSOR.SSM_IN) + ".weight": "mixer.in_proj.weight",
    layer_name(MODEL_TENSOR.SSM_CONV1D) + ".weight": "mixer.conv1d.weight",
    layer_name(MODEL_TENSOR.SSM_X) + ".weight": "mixer.bcdt_proj.weight",
    layer_name(MODEL_TENSOR.SSM_DT) + ".weight": "mixer.dt_proj.weight",
    layer_name(MODEL_TENSOR.SSM_DT) + ".bias": "mixer.dt_bias",
    layer_name(MODEL_TENSOR.SSM_DT_NORM): "mixer.dt_norm_weight",
    layer_name(MODEL_TENSOR.SSM_B_NORM): "mixer.B_norm_weight",
    layer_name(MODEL_TENSOR.SSM_C_NORM): "mixer.C_norm_weight",
    layer_name(MODEL_TENSOR.SSM_A): "mixer.A_log",
    layer_name(MODEL_TENSOR.SSM_D): "mixer.D",
    layer_name(MODEL_TENSOR.SSM_OUT) + ".weight": "mixer.out_proj.weight",
}
# The norms' offsets, which the converter adds to their weights (llmrun.models.plamo2's;
# not imported from there, which would import torch into `llmrun show`).
OFFSETS = {
    "pre_mixer_norm.weight": 1.0,
    "post_mixer_norm.weight": 1.0 / 5,
    "pre_mlp_norm.weight": 1.0,
    "post_mlp_norm.weight": 1.0 / 5**1.5,
    "model.norm.weight": 1.0,
}
# Tensors llama.cpp keeps in float; the loader edge changes them.
_FLOAT = ("mixer.A_log", "mixer.conv1d.weight", *OFFSETS)


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key of a plamo2 GGUF tensor, or None if it is not one."""
    return mapped_name(gguf_name, GLOBAL_NAMES, LAYER_NAMES, "model.layers.")


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Hub folder's weights under llmrun's keys ("model.layers.layers.N." ->
    "model.layers.N.")."""
    return {
        name.replace(_HUB_LAYERS, "model.layers.", 1) if name.startswith(_HUB_LAYERS) else name: w
        for name, w in weights.items()
    }


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Any) -> dict[str, Any]:
    """The config.json-style dict of a plamo2 GGUF, as llama_model_plamo2::load_arch_hparams
    reads it: a layer is Mamba where its KV head count is 0. rope_from_gguf:
    gguf_config._rope_from_gguf."""
    meta = ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    kv_heads = _per_layer(gg, meta, Keys.Attention.HEAD_COUNT_KV, layers)
    heads = _per_layer(gg, meta, Keys.Attention.HEAD_COUNT, layers)
    attention = [i for i in range(layers) if kv_heads[i]]
    if not attention:
        raise UnsupportedError(f"{gg.path}: a PLaMo 2 without attention layers")
    if len({heads[i] for i in attention}) != 1 or len({kv_heads[i] for i in attention}) != 1:
        raise UnsupportedError(
            f"{gg.path}: PLaMo 2 attention layers of different head counts are not supported"
        )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    head_dim = meta.require(Keys.Attention.KEY_LENGTH)
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{gg.path}: PLaMo 2 keys and values of different widths")
    inner = meta.require(Keys.SSM.INNER_SIZE)
    ssm_heads = meta.require(Keys.SSM.TIME_STEP_RANK)
    if ssm_heads * head_dim != inner:
        raise ModelFormatError(
            f"{gg.path}: ssm.inner_size {inner} is not ssm.time_step_rank {ssm_heads} heads "
            f"of attention.key_length {head_dim} (PLaMo 2's Mamba heads are attention-wide)"
        )
    if meta.get(Keys.SSM.GROUP_COUNT, 0) != 0:
        raise UnsupportedError(f"{gg.path}: PLaMo 2 with ssm.group_count other than 0")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads[attention[0]],
        "num_key_value_heads": kv_heads[attention[0]],
        "hidden_size_per_head": head_dim,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "vocab_size": vocab_size(gg, meta),
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "mamba_d_state": meta.require(Keys.SSM.STATE_SIZE),
        "mamba_d_conv": meta.require(Keys.SSM.CONV_KERNEL),
        "mamba_num_heads": ssm_heads,
        "layers_block_type": ["attention" if kv_heads[i] else "mamba" for i in range(layers)],
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "rope_parameters": rope_from_gguf(gg, meta, head_dim, context),
    }


def _per_layer(gg: GGUFFile, meta: ArchMetadata, key: str, layers: int) -> list[int]:
    value = meta.require(key)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise ModelFormatError(f"{gg.path}: {meta.name(key)} lists {len(values)} of {layers}")
    return values


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict:
    """A plamo2 GGUF's tensors as the model holds them: the norms without their offsets,
    A_log from A, the convolution [inner, 1, d_conv]; the rest as they are."""
    out = {}
    for name, w in weights.items():
        part = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if part not in _FLOAT:
            out[name] = w
            continue
        if w.ggml_type is not None:
            raise ModelFormatError(
                f"tensor {name} is quantized ({w.ggml_type.name}); llama.cpp keeps PLaMo 2's "
                "norms, A and convolution in float"
            )
        tensor = w.tensor.float()
        if part in OFFSETS:
            tensor = tensor - OFFSETS[part]
        elif part == "mixer.A_log":
            if (tensor >= 0).any():
                raise ModelFormatError(f"tensor {name}: A = -exp(A_log) must be negative")
            tensor = (-tensor).log().reshape(-1)
        else:
            tensor = tensor.reshape(tensor.shape[0], 1, -1)  # [C, K] -> [C, 1, K]
        out[name] = weight_type(tensor)
    return out


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a plamo2 config.json-style dict cache keys and values (its
    attention layers: llmrun.models.plamo2.is_mamba's rule, or a GGUF's layers_block_type),
    None for other models (llmrun.loading.inspect)."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layers_block_type")
    if kinds is not None:
        return kinds.count("attention")
    layers, step = config.get("num_hidden_layers", 32), config.get("mamba_step", 2)
    if not config.get("mamba_enabled", True):
        return layers
    if layers <= step // 2:
        return 1
    return sum(i % step == step // 2 for i in range(layers))
