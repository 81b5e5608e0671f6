"""SmallThinker GGUFs (arch "smallthinker") as llama.cpp's converter writes them
(conversion/smallthinker.py SmallThinkerModel) and llama.cpp reads them
(src/models/smallthinker.cpp), as the config of llmrun.models.smallthinker.

The converter writes TextModel's keys (q/k rows as they are: llama.cpp turns halves,
as the published code does), the expert count, used count and width (also as
feed_forward_length), expert_gating_func softmax where moe_primary_router_apply_softmax
else sigmoid, and attention.sliding_window only where some layer slides; it stacks the
experts and names the router ffn_gate_inp. It writes neither layout: llama.cpp reads a
file with a window as the 21B's, every fourth layer from the first global and without
RoPE (attention.sliding_window_pattern, default 4, first layer dense; NoPE every fourth
layer, no key) and the others sliding over 4096 positions whatever the key says; a file
without one as the 4B's, every layer global and rotating. It scores the router's logits
of the layer's input by the gating function, takes the top expert_used_count and
renormalizes their weights, unscaled (it reads no expert_weights_scale).

What llama.cpp computes otherwise than the published code is refused: a window other
than 4096, a sliding layers' RoPE base of their own, RoPE on part of each head.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, layer_name

ARCH = MODEL_TYPE = "smallthinker"
SLIDING_WINDOW = 4096  # llama_model_smallthinker::load_arch_hparams: hparams.n_swa = 4096
SWA_PATTERN = 4  # load_swa_pattern(ml, 4, true): layer i global where i % 4 == 0
NO_ROPE_STEP = 4  # hparams.n_no_rope_layer_step's default: layer i NoPE where i % 4 == 0
GATINGS = {ExpertGatingFuncType.SOFTMAX: True, ExpertGatingFuncType.SIGMOID: False}


# The mixture of experts, GGUF module (after "blk.N.") -> HF module (after
# "model.layers.N."), a stack's with an {expert} field; the rest has Llama's names.
MOE_NAMES = {
    layer_name(MODEL_TENSOR.FFN_GATE_INP): "block_sparse_moe.primary_router",
    layer_name(MODEL_TENSOR.FFN_GATE_EXP): "block_sparse_moe.experts.{expert}.gate",
    layer_name(MODEL_TENSOR.FFN_UP_EXP): "block_sparse_moe.experts.{expert}.up",
    layer_name(MODEL_TENSOR.FFN_DOWN_EXP): "block_sparse_moe.experts.{expert}.down",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF key of a smallthinker layer's router or stack of experts, or None."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
        return None
    module = MOE_NAMES.get(parts[2])
    return None if module is None else f"model.layers.{parts[1]}.{module}.weight"


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """SmallThinker's fields of the HF-style config that config_from_gguf built, read as
    llama_model_smallthinker::load_arch_hparams reads them (see the module docstring)."""
    path, arch = gg.path, gg.architecture

    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {arch}.expert_used_count is {used} and {arch}.expert_count {count}; "
            "SmallThinker routes each token to 1 to expert_count experts"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is None:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is missing (llama.cpp "
            "cannot run the file without it)"
        )
    if gating not in GATINGS:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is {gating}; "
            "SmallThinker's routers score by softmax (1) or sigmoid (2)"
        )
    width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs "
                "between layers, which SmallThinker's experts do not"
            )
        width = width[0]
    if not width:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} is missing"
        )
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    if rotated != head_dim:
        raise UnsupportedError(
            f"{path}: {arch}.rope.dimension_count is {rotated}, but SmallThinker turns whole "
            f"heads of {head_dim}"
        )
    layers = config["num_hidden_layers"]
    window = config.pop("sliding_window", None) or 0
    if window:
        if window != SLIDING_WINDOW:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.Attention.SLIDING_WINDOW)} is {window}, but "
                f"llama.cpp runs SmallThinker's sliding layers over {SLIDING_WINDOW} positions "
                "whatever the file says"
            )
        local_base = meta.get(Keys.Rope.FREQ_BASE_SWA)
        if local_base is not None and local_base != config["rope_parameters"]["rope_theta"]:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.Rope.FREQ_BASE_SWA)} differs from "
                f"{meta.name(Keys.Rope.FREQ_BASE)}; SmallThinker has one RoPE base"
            )
        sliding = _sliding_layers(gg, meta, layers)
        rotates = [int(i % NO_ROPE_STEP != 0) for i in range(layers)]
    else:
        sliding, rotates = [0] * layers, [1] * layers
    config.update(
        intermediate_size=width,
        moe_ffn_hidden_size=width,
        moe_num_primary_experts=count,
        moe_num_active_primary_experts=used,
        moe_primary_router_apply_softmax=GATINGS[gating],
        sliding_window_size=SLIDING_WINDOW,
        sliding_window_layout=sliding,
        rope_layout=rotates,
    )


def _sliding_layers(gg: GGUFFile, meta: ArchMetadata, layers: int) -> list[int]:
    """llama.cpp's load_swa_pattern(ml, 4, true): a per-layer bool array under
    attention.sliding_window_pattern, else an int n there (default 4): layer i slides
    where n == 0 or i % n != 0."""
    name = meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN)
    value = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN, SWA_PATTERN)
    if isinstance(value, list):
        if len(value) != layers:
            raise ModelFormatError(
                f"{gg.path}: {name} lists {len(value)} layers, but the model has {layers}"
            )
        return [int(bool(v)) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return [int(value == 0 or i % value != 0) for i in range(layers)]
    raise ModelFormatError(f"{gg.path}: {name} is {value!r}, not a layer count or a list of flags")
