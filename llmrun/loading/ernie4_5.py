"""ERNIE 4.5 GGUFs, dense (arch "ernie4_5") and with experts ("ernie4_5-moe"), and
PaddleOCR-VL's language model ("paddleocr": ERNIE 4.5 dense turned by M-RoPE, llama.cpp's
src/models/paddleocr.cpp), as llama.cpp's converter writes them (conversion/ernie.py),
and the Hub ERNIE 4.5 MoE folders' multi-token-prediction layers, which llmrun skips.

The converter keeps Hugging Face's q/k rows (ERNIE's RoPE rotates adjacent pairs,
llama.cpp's "normal" RoPE) and the common tensor names; it stacks each layer's experts
(ffn_{gate,up,down}_exps) and writes the router's selection bias as exp_probs_b.bias.
llama.cpp's graphs (src/models/ernie4-5.cpp, ernie4-5-moe.cpp) rotate whole heads and
have no biases in their feed-forward or output projections, so a file with either is
no model they run.
"""

from __future__ import annotations

from typing import Any

from gguf import ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import vl_text
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "ernie4_5", "ernie4_5"
MOE_ARCH, MOE_MODEL_TYPE = "ernie4_5-moe", "ernie4_5_moe"
PADDLEOCR_ARCH, PADDLEOCR_MODEL_TYPE = "paddleocr", "paddleocr_vl_text"
# The MoE layer's tensors that are not among the common names (GGUF -> HF module).
_MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
}
# The Hub's multi-token-prediction layers (mtp_block, mtp_emb_norm, ...), which
# transformers and llama.cpp's converter skip too.
MTP_PREFIX = "model.mtp_"


def moe_hf_name(gguf_name: str) -> str | None:
    """The HF key of an ernie4_5-moe expert-layer tensor (a template with `{expert}` for a
    stack of experts), or None for a tensor with a common name."""
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    name = _MOE_NAMES.get(parts[2])
    return None if name is None else f"model.layers.{parts[1]}.{name}"


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """ERNIE 4.5's fields of the HF-style config that config_from_gguf built."""
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT)
    if rotated not in (None, head_dim):
        raise ModelFormatError(
            f"{gg.path}: {gg.architecture}.rope.dimension_count is {rotated}, but ERNIE 4.5 "
            f"rotates whole heads of {head_dim}"
        )
    biases = sorted(
        name for name in gg.tensors if name.endswith(".bias") and "exp_probs_b" not in name
    )
    if biases:
        raise UnsupportedError(
            f"{gg.path}: an {gg.architecture} file with biases ({biases[0]}, ...) is not "
            "supported: llama.cpp's ERNIE 4.5 has none in its output and feed-forward "
            "projections"
        )
    config["use_bias"] = False
    if gg.architecture == MOE_ARCH:
        _moe_config(gg, config, meta)
    if gg.architecture == PADDLEOCR_ARCH:
        # llama.cpp turns it by M-RoPE (LLAMA_ROPE_TYPE_MROPE) always: its sections required.
        sections = vl_text.text_mrope_sections(gg, PADDLEOCR_ARCH, meta, head_dim, always=True)
        config["rope_parameters"]["mrope_section"] = sections[:3]


def _moe_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """The experts' fields, as llama.cpp reads them (llama_model_ernie4_5::load_arch_hparams
    and its graph): experts from leading_dense_block_count on, softmax gating, the chosen
    weights renormalized, shared experts expert_shared_feed_forward_length wide (none
    where it is absent)."""

    count = meta.require(Keys.LLM.EXPERT_COUNT)
    used = meta.require(Keys.LLM.EXPERT_USED_COUNT)
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    step = meta.require(Keys.LLM.INTERLEAVE_MOE_LAYER_STEP)
    shared = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {MOE_ARCH}.expert_used_count is {used}, but expert_count is {count}"
        )
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {MOE_ARCH}.expert_feed_forward_length differs between layers"
            )
        width = width[0]
    if step != 1:
        raise UnsupportedError(
            f"{gg.path}: {MOE_ARCH}.interleave_moe_layer_step is {step}; llama.cpp loads "
            "experts in every layer past the leading dense ones, so only 1 is supported"
        )
    if shared % width:
        raise ModelFormatError(
            f"{gg.path}: {MOE_ARCH}.expert_shared_feed_forward_length {shared} is no whole "
            f"number of experts {width} wide"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE)
    if gating not in (None, ExpertGatingFuncType.SOFTMAX) or scale not in (None, 0.0, 1.0):
        raise UnsupportedError(
            f"{gg.path}: {MOE_ARCH} experts gated other than by softmax, or with scaled "
            "weights, are not supported"
        )
    config.update(
        moe_num_experts=count,
        num_experts=count,  # the loader's name for the stacks' count
        moe_k=used,
        moe_intermediate_size=width,
        moe_num_shared_experts=shared // width,
        moe_layer_start_index=meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        moe_layer_end_index=config["num_hidden_layers"] - 1,
        moe_layer_interval=step,
    )


def gguf_weights(weights: dict[str, Any], weight: type) -> dict[str, Any]:
    """The router biases as the Hub's [1, experts] (the file may hold [experts])."""
    for name, w in weights.items():
        if name.endswith("e_score_correction_bias") and len(w.shape) == 1:
            weights[name] = weight(w.tensor.reshape(1, -1))
    return weights


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Hub ERNIE 4.5 MoE folder's weights without its multi-token-prediction layers."""
    return {name: w for name, w in weights.items() if not name.startswith(MTP_PREFIX)}
