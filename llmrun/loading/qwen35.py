"""Qwen3.5 and Qwen3.5-MoE (and Qwen3-Next, llmrun.loading.qwen3_next) at the loader edge: Hugging Face folders (the language model
of Qwen3_5ForConditionalGeneration, or a text-only Qwen3_5ForCausalLM) and GGUFs of
llama.cpp's archs "qwen35" and "qwen35moe" as its converter writes them
(conversion/qwen.py Qwen3_5TextModel, Qwen3_5MoeTextModel and their bases), read as
src/models/qwen35.cpp and qwen35moe.cpp read them.

What the converter changes, and how it is undone: every RMSNorm weight but the gated one
(linear_attn.norm, ssm_norm) is stored as 1 + w (the loader subtracts 1); A_log as
-exp(A_log) (ssm_a; log(-x) gives it back); dt_bias as ssm_dt.bias; the depthwise
convolution [channels, 1, kernel] squeezed to [channels, kernel]. Where there are more
value heads than key heads it reorders the value heads from grouped by key head to tiled
(in_proj_qkv's value rows, in_proj_z, in_proj_a/b, A_log, dt_bias, the convolution's value
channels and out_proj's columns alike); the model takes them so (tiled_value_heads), as
llama.cpp's graph does, since out_proj's columns could not be reordered in blocks. The
M-RoPE sections only matter for image positions (kept for them, llmrun.models.mrope): for
text every section turns by the token's position, which is ordinary RoPE.
Multi-token-prediction layers (blk.N past block_count - nextn_predict_layers) are
skipped, as llama.cpp's inference skips them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, qwen3_next, vl_text
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size
from llmrun.loading.glm4_moe import NEXTN, trunk_layers

ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", qwen3_next.ARCH: qwen3_next.MODEL_TYPE}
MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
# llama-arch.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS (newer than the gguf package here).
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default where a file gives no layer pattern


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF tensor (after blk.N., without its suffix) -> llmrun's module in the layer.
_LAYER_NAMES = {
    _short(t): name
    for t, name in [
        (MODEL_TENSOR.ATTN_NORM, "input_layernorm"),
        (MODEL_TENSOR.ATTN_POST_NORM, "post_attention_layernorm"),
        (MODEL_TENSOR.ATTN_Q, "self_attn.q_proj"),
        (MODEL_TENSOR.ATTN_K, "self_attn.k_proj"),
        (MODEL_TENSOR.ATTN_V, "self_attn.v_proj"),
        (MODEL_TENSOR.ATTN_OUT, "self_attn.o_proj"),
        (MODEL_TENSOR.ATTN_Q_NORM, "self_attn.q_norm"),
        (MODEL_TENSOR.ATTN_K_NORM, "self_attn.k_norm"),
        (MODEL_TENSOR.ATTN_QKV, "linear_attn.in_proj_qkv"),
        (MODEL_TENSOR.ATTN_GATE, "linear_attn.in_proj_z"),
        (MODEL_TENSOR.SSM_BETA, "linear_attn.in_proj_b"),
        (MODEL_TENSOR.SSM_ALPHA, "linear_attn.in_proj_a"),
        (MODEL_TENSOR.SSM_BETA_ALPHA, "linear_attn.in_proj_ba"),  # Qwen3-Next's, split
        (MODEL_TENSOR.SSM_CONV1D, "linear_attn.conv1d"),
        (MODEL_TENSOR.SSM_NORM, "linear_attn.norm"),
        (MODEL_TENSOR.SSM_OUT, "linear_attn.out_proj"),
        (MODEL_TENSOR.FFN_GATE, "mlp.gate_proj"),
        (MODEL_TENSOR.FFN_UP, "mlp.up_proj"),
        (MODEL_TENSOR.FFN_DOWN, "mlp.down_proj"),
        (MODEL_TENSOR.FFN_GATE_INP, "mlp.gate"),
        (MODEL_TENSOR.FFN_GATE_INP_SHEXP, "mlp.shared_expert_gate"),
        (MODEL_TENSOR.FFN_GATE_SHEXP, "mlp.shared_expert.gate_proj"),
        (MODEL_TENSOR.FFN_UP_SHEXP, "mlp.shared_expert.up_proj"),
        (MODEL_TENSOR.FFN_DOWN_SHEXP, "mlp.shared_expert.down_proj"),
    ]
}
_EXPERT_STACKS = {
    _short(MODEL_TENSOR.FFN_GATE_EXP): "gate_proj",
    _short(MODEL_TENSOR.FFN_UP_EXP): "up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_EXP): "down_proj",
}
_GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.norm",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
}
_SSM_A = _short(MODEL_TENSOR.SSM_A)  # no .weight: llama.cpp's LLM_TENSOR_SSM_A_NOSCAN
_SSM_DT = _short(MODEL_TENSOR.SSM_DT)  # .bias: HF's dt_bias
_GATED_NORM = "linear_attn.norm.weight"  # the one norm stored as it is


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a tensor of a qwen35/qwen35moe GGUF (a stack of
    experts: a template with an `{expert}` field), or None if the model has no such
    tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] == _SSM_A:
        return f"model.layers.{parts[1]}.linear_attn.A_log"
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name = f"model.layers.{parts[1]}", parts[2]
    if name == _SSM_DT and suffix == "bias":
        return f"{layer}.linear_attn.dt_bias"
    if suffix != "weight":
        return None
    if name in _EXPERT_STACKS:
        return f"{layer}.mlp.experts.{{expert}}.{_EXPERT_STACKS[name]}.weight"
    if name in _LAYER_NAMES:
        return f"{layer}.{_LAYER_NAMES[name]}.weight"
    return None


def config_from_gguf(
    gg: GGUFFile, rope_from_gguf: Callable[..., dict], model_type: str | None = None
) -> dict[str, Any]:
    """The HF-style config of a qwen35/qwen35moe GGUF, read as llama_model_qwen35(moe)::
    load_arch_hparams reads it (rope_from_gguf: gguf_config's RoPE reader); `model_type`
    where an arch that builds on them (qwen4exp, with experts) reads its own keys after."""
    arch = gg.architecture
    meta = ArchMetadata.of(gg)
    if f"blk.0.{_short(MODEL_TENSOR.SSM_IN)}.weight" in gg.tensors:
        raise UnsupportedError(
            f"{gg.path}: the older qwen3next form, with in_proj_qkvz fused as ssm_in, is not "
            "supported; convert the model again with a current llama.cpp"
        )
    layers, nextn = trunk_layers(gg, arch)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    value_length = meta.get(Keys.Attention.VALUE_LENGTH, head_dim)
    if value_length != head_dim:
        raise ModelFormatError(
            f"{gg.path}: attention key length {head_dim} and value length {value_length} "
            "differ; Qwen3.5's attention heads have one width"
        )
    scale = meta.get(Keys.Attention.SCALE)
    if scale and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        raise UnsupportedError(
            f"{gg.path}: an attention scale of {scale} (not head_dim^-0.5) is not supported"
        )
    state = meta.require(Keys.SSM.STATE_SIZE)
    inner = meta.require(Keys.SSM.INNER_SIZE)
    k_heads = meta.require(Keys.SSM.GROUP_COUNT)
    v_heads = meta.require(Keys.SSM.TIME_STEP_RANK)
    if not k_heads or not v_heads or inner != v_heads * state:
        # llama.cpp's tensors take value heads of the state size (load_arch_tensors).
        raise ModelFormatError(
            f"{gg.path}: ssm.inner_size {inner} is not ssm.time_step_rank {v_heads} value "
            f"heads of ssm.state_size {state}, as llama.cpp's qwen35 tensors are laid out"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    rope = rope_from_gguf(gg, meta, head_dim, context)
    # llama.cpp turns rope.dimension_count features, the whole head where the key is
    # absent; said here, since the model's default is transformers' quarter.
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    rope["partial_rotary_factor"] = rotated / head_dim
    sections = vl_text.interleaved_sections(meta, rotated)
    if sections is not None:  # a prompt with images turns by them
        rope.update(mrope_section=sections, mrope_interleaved=True)
    config: dict[str, Any] = {
        "model_type": model_type or ARCHS[arch],
        "hidden_size": hidden,
        # Optional for qwen35moe, whose layers all have experts (checked below for qwen35).
        "intermediate_size": meta.get(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        NEXTN: nextn,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": False,
        "linear_conv_kernel_dim": meta.require(Keys.SSM.CONV_KERNEL),
        "linear_key_head_dim": state,
        "linear_value_head_dim": state,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "layer_types": _layer_types(gg, meta, layers, nextn),
        # Qwen3.5's converter tiles the value heads; Qwen3-Next's leaves them grouped.
        "tiled_value_heads": v_heads != k_heads and arch != qwen3_next.ARCH,
        "rope_parameters": rope,
    }
    if arch != "qwen35":
        _moe_config(gg, config, meta)
    elif meta.get(Keys.LLM.EXPERT_COUNT, 0):
        raise ModelFormatError(f"{gg.path}: a qwen35 (dense) file with experts")
    if not config["intermediate_size"] and arch == "qwen35":
        raise ModelFormatError(f"{gg.path}: metadata 'qwen35.feed_forward_length' is missing")
    return config


def _layer_types(gg: GGUFFile, meta: ArchMetadata, layers: int, nextn: int) -> list[str]:
    """Which layers are linear attention: attention.recurrent_layers (one flag per block,
    MTP blocks included), else every full_attention_interval-th layer is full attention."""
    flags = gg.metadata.get(RECURRENT_LAYERS.format(arch=gg.architecture))
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != layers + nextn:
            raise ModelFormatError(
                f"{gg.path}: {RECURRENT_LAYERS.format(arch=gg.architecture)} should list "
                f"{layers + nextn} layers"
            )
        recurrent = [bool(f) for f in flags[:layers]]
    else:
        interval = meta.get(Keys.LLM.FULL_ATTENTION_INTERVAL)
        interval = FULL_ATTENTION_INTERVAL if interval is None else interval
        if not isinstance(interval, int) or interval <= 0:
            raise ModelFormatError(
                f"{gg.path}: full_attention_interval is {interval!r}, not a layer count"
            )
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    return ["linear_attention" if r else "full_attention" for r in recurrent]


def _moe_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """The experts' fields, read as llama_model_qwen35moe and llama_model_qwen3next read
    them (every layer has experts): softmax gating with
    the top-k renormalized (its graph fixes both), expert widths defaulting to
    feed_forward_length / expert_used_count and (shared) feed_forward_length."""
    arch = gg.architecture

    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not count or not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_COUNT)} is {count} and "
            f"{meta.name(Keys.LLM.EXPERT_USED_COUNT)} {used}; a {arch} file has experts"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is not None and gating != ExpertGatingFuncType.SOFTMAX:
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is {gating}; {arch} experts "
            "are gated by softmax"
        )
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE)
    if scale not in (None, 0.0, 1.0):
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_WEIGHTS_SCALE)} is {scale}; llmrun supports "
            "unscaled expert weights only"
        )
    ff = config["intermediate_size"] or 0
    width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    shared = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH) or ff
    width = width or ff // used
    if not width or not shared:
        raise ModelFormatError(
            f"{gg.path}: the experts' widths are missing "
            f"({meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)}, "
            f"{meta.name(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)})"
        )
    config.update(
        num_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=shared,
    )


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The GGUF's weights as the model takes them (see the module docstring): norms less
    1 (but the gated one), A_log from ssm_a, the convolution [channels, 1, kernel],
    Qwen3-Next's ssm_ba split. `weight_type` is the loader's Weight."""
    import torch

    out = {}
    for name, w in weights.items():
        if name.endswith("norm.weight") and not name.endswith(_GATED_NORM):
            w = weight_type(w.tensor.float() - 1.0)
        elif name.endswith(".A_log"):
            w = weight_type(torch.log(-w.tensor.float()))
        elif name.endswith("conv1d.weight"):
            if w.ggml_type is not None or w.tensor.dim() != 2:
                raise ModelFormatError(
                    f"{name}: the convolution should be float [channels, kernel], not "
                    f"{list(w.shape)}"
                )
            w = weight_type(w.tensor[:, None, :])
        out[name] = w
    if config["model_type"] == qwen3_next.MODEL_TYPE:
        out = qwen3_next.split_weights(out, config, weight_type)
    return out


# A multimodal folder's language model under its *ForCausalLM names; the vision tower and
# the multi-token-prediction layers, which llmrun does not run, are left out.
_TEXT_PREFIXES = {"model.language_model.": "model."}
_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
# transformers 5's stacked experts of a layer (llmrun.loading.experts).
_STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """A Qwen3.5 folder's language-model config and weights, under the names the model
    has: a multimodal config's text_config (its model_type made the family's), fused
    experts (transformers 5's experts.gate_up_proj [E, 2I, D] and experts.down_proj
    [E, D, I]) as each expert's views. Also whether the folder had a vision tower."""
    multimodal = isinstance(config.get("text_config"), dict)
    if multimodal:
        text = dict(config["text_config"])
        text["model_type"] = config["model_type"].removesuffix("_text")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if name not in text and name in config:
                text[name] = config[name]
        config = text
    out = {}
    for name, w in weights.items():
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
        out[name] = w
    if "moe_intermediate_size" in config:
        hidden, width = config["hidden_size"], config["moe_intermediate_size"]
        out = experts.split_stacked(out, _STACKED_EXPERTS, hidden, width, weight_type)
    if config.get("model_type") == qwen3_next.MODEL_TYPE:
        out = qwen3_next.split_weights(out, config, weight_type)
    return config, out, multimodal


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a Qwen3.5 config.json-style dict keep keys and values (its
    full-attention ones; the Gated DeltaNet layers keep a state of fixed size); None for
    another family."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    kinds = config.get("layer_types")
    if kinds:
        return sum(kind == "full_attention" for kind in kinds)
    interval = int(config.get("full_attention_interval") or FULL_ATTENTION_INTERVAL)
    return int(config["num_hidden_layers"]) // interval
