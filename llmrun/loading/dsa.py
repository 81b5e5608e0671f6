"""DeepSeek-V3.2 and GLM-5 at the loader edge: GGUFs of llama.cpp's archs "deepseek32"
and "glm-dsa" as its converter writes them (conversion/deepseek.py DeepseekV32Model,
conversion/glm.py GlmMoeDsaModel) and llama.cpp reads them (src/models/deepseek32.cpp,
glm-dsa.cpp), as the config and tensors of llmrun's deepseek_v32 and glm_moe_dsa models.

Both are deepseek2 files (llmrun/loading/deepseek2.py: MLA split into attn_k_b and
attn_v_b, stacked experts, the YaRN log multiplier) plus the indexer: its sizes under
attention.indexer.* (head_count, key_length, top_k, all required) and its tensors
blk.N.indexer.{attn_q_b, attn_k, k_norm (weight and bias), proj}, which the converter
writes as the checkpoint holds them (no permutation: GLM-5's adjacent-pair RoPE stays
as it is, as in the main attention). Their experts are sigmoid-gated: deepseek32 files
must say so (llama.cpp requires expert_gating_func), glm-dsa ones default to it. A
glm-dsa file's attention.indexer.types (true: a full layer) says which layers run their
own indexer; without it llama.cpp takes every layer to be full for a context below 1M
(GLM-5, 5.1), else GLM-5.2's pattern. The files end with nextn_predict_layers
multi-token-prediction layers (counted in block_count), which llmrun skips, as
llama.cpp's inference does.
"""

from __future__ import annotations

import copy
from typing import Any

from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    ExpertGatingFuncType,
    Keys,
)

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2
from llmrun.loading.gguf_io import ArchMetadata, layer_name

# gguf 0.19 names no MODEL_ARCH for DeepSeek-V3.2 (llama.cpp's constants.py does).
DEEPSEEK32 = "deepseek32"
GLM_DSA = MODEL_ARCH_NAMES[MODEL_ARCH.GLM_DSA]
ARCHS = {DEEPSEEK32: "deepseek_v32", GLM_DSA: "glm_moe_dsa"}
MODEL_TYPES = tuple(ARCHS.values())
# gguf 0.19 lacks Keys.Attention.Indexer.TYPES; llama.cpp's constants.py spells it so.
INDEXER_TYPES = "{arch}.attention.indexer.types"
# llama.cpp's glm-dsa defaults (load_arch_hparams): every layer full below this context;
# from it on GLM-5.2's layers (GLM_5_2_DEFAULT_INDEXER_TYPES): the first 2, then every
# 4th from layer 2, of its 78; any beyond those shared.
GLM_5_2_CONTEXT = 1048576
GLM_5_2_LAYERS = 78


# GGUF tensor (after blk.N., without .weight/.bias) -> the model's indexer module.
INDEXER_NAMES = {
    layer_name(MODEL_TENSOR.INDEXER_ATTN_Q_B): "wq_b",
    layer_name(MODEL_TENSOR.INDEXER_ATTN_K): "wk",
    layer_name(MODEL_TENSOR.INDEXER_K_NORM): "k_norm",
    layer_name(MODEL_TENSOR.INDEXER_PROJ): "weights_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a deepseek32/glm-dsa GGUF tensor (deepseek2's names,
    and the indexer's), or None if the model has no such tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 5 and parts[0] == "blk" and parts[1].isdigit():
        module = INDEXER_NAMES.get(f"{parts[2]}.{parts[3]}")
        if module is None or parts[4] not in ("weight", "bias"):
            return None
        return f"model.layers.{parts[1]}.self_attn.indexer.{module}.{parts[4]}"
    return deepseek2.hf_name(gguf_name)


def config_from_gguf(gg, rope_from_gguf) -> dict[str, Any]:
    """An HF-style deepseek_v32/glm_moe_dsa config from the file's metadata: deepseek2's
    reading, the experts' sigmoid gating, and the indexer's keys."""
    path, arch = gg.path, gg.architecture
    gating_key = Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch)
    gating = gg.metadata.get(gating_key)
    if gating is None and arch == DEEPSEEK32:
        raise ModelFormatError(f"{path}: metadata {gating_key!r} is missing ({arch} needs it)")
    if gating is None:  # glm-dsa: llama.cpp's default
        gg = copy.copy(gg)
        gg.metadata = {**gg.metadata, gating_key: int(ExpertGatingFuncType.SIGMOID)}
    elif gating != ExpertGatingFuncType.SIGMOID:
        raise UnsupportedError(
            f"{path}: {gating_key} is {gating}; {arch} experts are sigmoid-gated "
            f"({int(ExpertGatingFuncType.SIGMOID)}), the only gating llmrun's model has"
        )
    config = deepseek2.config_from_gguf(gg, rope_from_gguf)
    if config.get("q_lora_rank") is None:
        raise UnsupportedError(f"{path}: a {arch} file without attn_q_a is not supported")

    meta = ArchMetadata.of(gg)
    config.update(
        model_type=ARCHS[arch],
        index_n_heads=meta.require(Keys.Attention.Indexer.HEAD_COUNT),
        index_head_dim=meta.require(Keys.Attention.Indexer.KEY_LENGTH),
        index_topk=meta.require(Keys.Attention.Indexer.TOP_K),
    )
    if arch == GLM_DSA:
        config["indexer_types"] = _indexer_types(gg, config)
    return config


def _indexer_types(gg, config: dict[str, Any]) -> list[str]:
    """Each layer's indexer, "full" or "shared", as llama.cpp's glm-dsa reads it."""
    layers, name = config["num_hidden_layers"], INDEXER_TYPES.format(arch=gg.architecture)
    full = gg.metadata.get(name)
    if full is None:
        if config["max_position_embeddings"] < GLM_5_2_CONTEXT:
            full = [True] * layers
        else:
            full = [i < GLM_5_2_LAYERS and max(i - 2, 0) % 4 == 0 for i in range(layers)]
    elif not isinstance(full, list):  # one value for every layer (get_key_or_arr)
        full = [full] * layers
    if len(full) < layers:
        raise ModelFormatError(f"{gg.path}: {name} has {len(full)} entries for {layers} layers")
    return ["full" if f else "shared" for f in full[:layers]]


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """deepseek2's joining of attn_k_b and attn_v_b into kv_b_proj, and its zero
    selection bias where a file has none (the model is DeepSeek-V3's)."""
    return deepseek2.gguf_weights(weights, {**config, "model_type": "deepseek_v3"}, weight_type)
