"""Hunyuan V3 checkpoints at the loader edge: the Hub's folders, and GGUFs (arch
"hy_v3") as llama.cpp's converter writes them (conversion/hunyuan.py HYV3Model), read
as src/models/hy-v3.cpp reads them.

The Hub's keys name the router mlp.router.gate, the selection bias mlp.expert_bias and
the shared expert mlp.shared_mlp; transformers renames them (conversion_mapping.py) to
the names llmrun's model carries, and so does hf_weights, which also splits the stacked
experts transformers 5 saves and drops the multi-token-prediction layers.

The converter keeps q/k rows as they are (llama.cpp rotates hy_v3 with NEOX RoPE), the
experts stacked, the selection bias as exp_probs_b (no .bias suffix), the shared
experts' width as expert_shared_feed_forward_length, route_norm as
expert_weights_norm, router_scaling_factor as expert_weights_scale, and, with its MTP
layers (the default), block_count as num_hidden_layers + nextn_predict_layers. It
writes no dense-layer count: llama.cpp runs a layer with experts where its file has a
router (ffn_gate_inp), else a dense feed-forward, and so does llmrun.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, glm4_moe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

# gguf-py's MODEL_ARCH.HY_V3 (newer than the gguf package llmrun depends on).
ARCH = MODEL_TYPE = "hy_v3"


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensor -> the module in llmrun's layer where it differs from the common
# names (gguf_config); a stack of experts names each expert's with an {expert} field.
_LAYER_NAMES = {
    _short(MODEL_TENSOR.FFN_GATE_INP): "mlp.gate",
    _short(MODEL_TENSOR.FFN_GATE_SHEXP): "mlp.shared_experts.gate_proj",
    _short(MODEL_TENSOR.FFN_UP_SHEXP): "mlp.shared_experts.up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_SHEXP): "mlp.shared_experts.down_proj",
    _short(MODEL_TENSOR.FFN_GATE_EXP): "mlp.experts.{expert}.gate_proj",
    _short(MODEL_TENSOR.FFN_UP_EXP): "mlp.experts.{expert}.up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_EXP): "mlp.experts.{expert}.down_proj",
}
_SELECTION_BIAS = _short(MODEL_TENSOR.FFN_EXP_PROBS_B)
_BIAS_KEY = "mlp.e_score_correction_bias"
# The Hub's names -> transformers' (and llmrun's), inside a layer.
_HUB_NAMES = {
    ".mlp.router.gate.": ".mlp.gate.",
    ".mlp.expert_bias": "." + _BIAS_KEY,
    ".mlp.shared_mlp.": ".mlp.shared_experts.",
}
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a hy_v3 layer tensor, or None where it is not one of Hunyuan
    V3's own (the common names apply then)."""
    parts = gguf_name.split(".")
    if len(parts) < 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer = f"model.layers.{parts[1]}"
    if parts[2:] == [_SELECTION_BIAS]:
        return f"{layer}.{_BIAS_KEY}"
    if len(parts) == 4 and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"{layer}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Hunyuan V3's fields of the HF-style config that config_from_gguf built, as
    llama_model_hy_v3::load_arch_hparams reads them: the trunk's layers (block_count
    less nextn_predict_layers), a layer's experts where it has a router, sigmoid gating
    where no key says otherwise, the expert width feed_forward_length / expert_used_count
    and the shared width the expert width where the keys are absent, no scale where
    expert_weights_scale is 0 or absent. Refuses softmax gating, top-k weights that are
    not renormalized (absent expert_weights_norm included: llama.cpp's default), shared
    experts not a whole number of experts wide, and partial RoPE (llama.cpp asserts
    whole heads)."""
    path = gg.path
    layers, nextn = glm4_moe.trunk_layers(gg, ARCH)
    config.update(num_hidden_layers=layers)
    config[glm4_moe.NEXTN] = nextn
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, 0)
    if gating not in (0, ExpertGatingFuncType.SIGMOID):  # 0: none given, sigmoid
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; Hunyuan V3's experts are gated "
            "by sigmoid, the only gating llmrun runs them with"
        )
    if not meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False):
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_WEIGHTS_NORM)} is false or absent; Hunyuan V3 "
            "renormalizes its top-k expert weights, and llmrun runs it that way only"
        )
    width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) or config["intermediate_size"] // used
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    shared_width = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH) or width
    if shared_width % width:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)} {shared_width} is "
            f"not a whole number of experts {width} wide, which llmrun's Hunyuan V3 needs"
        )
    if config["rope_parameters"].get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{config['head_dim']}; Hunyuan V3 rotates whole heads"
        )
    config.update(
        num_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        num_shared_experts=shared_width // width,
        router_scaling_factor=meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        mlp_layer_types=[
            "sparse" if f"blk.{i}.ffn_gate_inp.weight" in gg.tensors else "dense"
            for i in range(layers)
        ],
    )


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A Hub folder's weights under llmrun's keys: the router, selection bias and shared
    expert renamed as transformers renames them, stacked experts (what transformers 5
    saves) split per expert, the multi-token-prediction layers past num_hidden_layers
    dropped (transformers ignores them too). `weight_type` is the loader's Weight."""
    layers = config.get("num_hidden_layers", 0)
    out = {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        for old, new in _HUB_NAMES.items():
            name = name.replace(old, new)
        out[name] = w
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 1536)
    return experts.split_stacked(out, _STACKED, hidden, width, weight_type)


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The file's weights, with a zero selection bias for each layer with experts whose
    file has none (llama.cpp's: exp_probs_b is optional). `weight_type` is the loader's
    Weight."""
    import torch

    out = dict(weights)
    for layer, kind in enumerate(config["mlp_layer_types"]):
        bias = f"model.layers.{layer}.{_BIAS_KEY}"
        if kind == "sparse" and bias not in out:
            out[bias] = weight_type(torch.zeros(config["num_experts"]))
    return out
