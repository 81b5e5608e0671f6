"""Hunyuan dense GGUFs (arch "hunyuan-dense") as llama.cpp's converter writes them
(conversion/hunyuan.py HunYuanModel: TextModel's keys, q/k rows as they are for its
NEOX RoPE, NTK-alpha RoPE written as the stretched base it comes to, with a 256K
context), read as src/models/hunyuan-vl.cpp reads them (llama_model_hunyuan_dense is
its subclass): a rope.scaling.alpha key, where a file has one, stretches the base as
the converter would have, and the q/k norms act after RoPE.

Hunyuan MoE GGUFs (arch "hunyuan-moe", Hunyuan-A13B) as HunYuanMoEModel writes them:
the same attention and RoPE, the experts stacked, the router (mlp.gate.wg) as
ffn_gate_inp, the shared expert (mlp.shared_mlp) as ffn_*_shexp with its width as
expert_shared_feed_forward_length (the config's intermediate_size), the experts' as
expert_feed_forward_length, moe_topk as expert_used_count; read as
src/models/hunyuan-moe.cpp reads them: softmax gating and renormalized top-k weights,
which it reads no key for (a file whose keys say otherwise is refused), and no
rope.scaling.alpha key.
"""

from __future__ import annotations

from typing import Any

from gguf import ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = "hunyuan-dense"
MODEL_TYPE = "hunyuan_v1_dense"
MOE_ARCH = "hunyuan-moe"
MOE_MODEL_TYPE = "hunyuan_v1_moe"
# GGUF layer tensor -> HF module, where Hunyuan differs from the common names.
LAYER_NAMES = {
    "attn_q_norm": "self_attn.query_layernorm",
    "attn_k_norm": "self_attn.key_layernorm",
}
# ... and those of Hunyuan MoE's feed-forward; a stack of experts names each expert's
# module with an {expert} field.
MOE_LAYER_NAMES = {
    **LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate.wg",
    "ffn_gate_shexp": "mlp.shared_mlp.gate_proj",
    "ffn_up_shexp": "mlp.shared_mlp.up_proj",
    "ffn_down_shexp": "mlp.shared_mlp.down_proj",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Hunyuan's fields of the HF-style config that config_from_gguf built: the RoPE base
    stretched by rope.scaling.alpha where the file has one (llama_model_hunyuan_vl::
    load_arch_hparams). Refuses partial RoPE and M-RoPE sections (Hunyuan-VL's XD-RoPE),
    which llmrun's Hunyuan dense does not compute."""
    _refuse_partial_rope(gg, config, meta)
    head_dim = config["head_dim"]
    alpha = meta.get(Keys.Rope.SCALING_ALPHA, 0.0)
    if alpha > 0:
        config["rope_parameters"]["rope_theta"] *= alpha ** (head_dim / (head_dim - 2))


def moe_hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a layer tensor of a hunyuan-moe GGUF where Hunyuan names it
    otherwise than the common names (gguf_config); None for the others."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    if parts[2] not in MOE_LAYER_NAMES or parts[3] != "weight":
        return None
    return f"model.layers.{parts[1]}.{MOE_LAYER_NAMES[parts[2]]}.weight"


def finish_moe_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Hunyuan MoE's fields of the HF-style config that config_from_gguf built, read as
    llama_model_hunyuan_moe::load_arch_hparams reads them: the experts' width
    (expert_feed_forward_length, required), the shared expert's
    (expert_shared_feed_forward_length, else feed_forward_length). Refuses what that
    graph does not compute or what it would read otherwise than the file says: partial
    RoPE, M-RoPE sections, a rope.scaling.alpha key (llama.cpp reads none for this
    arch), gating other than softmax, top-k weights not renormalized, scaled weights."""
    path = gg.path
    _refuse_partial_rope(gg, config, meta)
    if meta.get(Keys.Rope.SCALING_ALPHA) is not None:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Rope.SCALING_ALPHA)} is set, which llama.cpp does "
            f"not read for {MOE_ARCH} (its converter writes the stretched base instead)"
        )
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to "
            f"{count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, ExpertGatingFuncType.SOFTMAX)
    norm = meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, True)
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)
    if gating != ExpertGatingFuncType.SOFTMAX or not norm or scale not in (0.0, 1.0):
        raise UnsupportedError(
            f"{path}: {MOE_ARCH}'s experts are gated by a softmax, their top-k weights "
            f"renormalized and unscaled, but the file says expert_gating_func {gating}, "
            f"expert_weights_norm {norm}, expert_weights_scale {scale}"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs "
                "between layers, which llmrun does not support"
            )
        width = width[0]
    shared = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH) or config["intermediate_size"]
    config.update(
        num_experts=count, moe_topk=used, moe_intermediate_size=width, intermediate_size=shared
    )


def _refuse_partial_rope(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Refuse partial RoPE and M-RoPE sections (Hunyuan-VL's XD-RoPE), which llmrun's
    Hunyuan does not compute."""
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{config['head_dim']}; Hunyuan rotates whole heads"
        )
    sections = meta.get(Keys.Rope.DIMENSION_SECTIONS)
    if sections and any(sections):
        raise UnsupportedError(
            f"{gg.path}: a {meta.arch} file with M-RoPE sections (Hunyuan-VL's XD-RoPE) is not supported"
        )
