"""Mamba and Falcon Mamba at the loader edge: "mamba" GGUFs as llama.cpp's converter
writes them (conversion/mamba.py MambaModel) and llama.cpp reads them (src/models/
mamba.cpp, mamba-base.cpp build_mamba_layer).

What the converter does, undone here: A_log is stored as A = -exp(A_log), the
convolution [inner, 1, conv_kernel] as [inner, conv_kernel], the output matrix left out
where it equals the embedding (tied). Falcon Mamba is written as "mamba" with
ssm.dt_b_c_rms true; llama.cpp then normalizes dt, B and C with the model's
layer_norm_rms_eps (the file has no mixer_rms_eps), and so does llmrun. llama.cpp reads
no bias of in_proj or out_proj and requires the convolution's; its context length
(2**20, "arbitrary" says the converter) is not the model's, so none is taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, layer_name

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "mamba"
MODEL_TYPES = ("mamba", "falcon_mamba")


GLOBAL_NAMES = {
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight": "backbone.embeddings.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]}.weight": "backbone.norm_f.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight": "lm_head.weight",
}
# GGUF tensor (after "blk.N.", with its suffix; A and D have none) -> HF key (after
# "backbone.layers.N.").
LAYER_NAMES = {
    f"{layer_name(MODEL_TENSOR.ATTN_NORM)}.weight": "norm.weight",
    f"{layer_name(MODEL_TENSOR.SSM_IN)}.weight": "mixer.in_proj.weight",
    f"{layer_name(MODEL_TENSOR.SSM_CONV1D)}.weight": "mixer.conv1d.weight",
    f"{layer_name(MODEL_TENSOR.SSM_CONV1D)}.bias": "mixer.conv1d.bias",
    f"{layer_name(MODEL_TENSOR.SSM_X)}.weight": "mixer.x_proj.weight",
    f"{layer_name(MODEL_TENSOR.SSM_DT)}.weight": "mixer.dt_proj.weight",
    f"{layer_name(MODEL_TENSOR.SSM_DT)}.bias": "mixer.dt_proj.bias",
    layer_name(MODEL_TENSOR.SSM_A): "mixer.A_log",
    layer_name(MODEL_TENSOR.SSM_D): "mixer.D",
    f"{layer_name(MODEL_TENSOR.SSM_OUT)}.weight": "mixer.out_proj.weight",
}
# Kept in float by llama.cpp's quantizer; llmrun reads them so.
_FLOAT_PARTS = ("mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_proj.bias")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face key of a "mamba" GGUF tensor, or None if it has none."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    name = LAYER_NAMES.get(parts[2])
    return None if name is None else f"backbone.layers.{parts[1]}.{name}"


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The HF config.json dict (mamba, or falcon_mamba with ssm.dt_b_c_rms) of a "mamba"
    GGUF, read as llama_model_mamba::load_arch_hparams reads it."""
    meta = ArchMetadata.of(gg, ARCH)
    embed = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    if embed is None:
        raise ModelFormatError(f"{gg.path}: tensor token_embd.weight is missing")
    eps = meta.require(Keys.Attention.LAYERNORM_RMS_EPS)
    falcon = bool(meta.get(Keys.SSM.DT_B_C_RMS, False))
    config: dict[str, Any] = {
        "model_type": MODEL_TYPES[falcon],
        "hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "intermediate_size": meta.require(Keys.SSM.INNER_SIZE),
        "state_size": meta.require(Keys.SSM.STATE_SIZE),
        "conv_kernel": meta.require(Keys.SSM.CONV_KERNEL),
        "time_step_rank": meta.require(Keys.SSM.TIME_STEP_RANK),
        "layer_norm_epsilon": eps,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight" not in gg.tensors,
    }
    if falcon:
        config["mixer_rms_eps"] = eps
    return config


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict[str, Any]:
    """A "mamba" GGUF's tensors as the model holds them: A_log from A, the convolution
    [inner, 1, conv_kernel]; `weight_type` wraps a tensor (loader.Weight)."""
    out = {}
    for name, w in weights.items():
        part = name.split(".", 3)[-1]  # after "backbone.layers.N."
        if part in (*_FLOAT_PARTS, "mixer.A_log", "mixer.D") and w.ggml_type is not None:
            raise ModelFormatError(
                f"tensor {name} is quantized ({w.ggml_type.name}); llama.cpp keeps Mamba's "
                "convolution, A, D and time-step bias in float"
            )
        if part == "mixer.A_log":
            if (w.tensor >= 0).any():
                raise ModelFormatError(f"tensor {name}: A = -exp(A_log) must be negative")
            w = weight_type(w.tensor.neg().log(), None, w.shape)
        elif part == "mixer.conv1d.weight":
            w = weight_type(w.tensor.unsqueeze(1), None, (w.shape[0], 1, w.shape[1]))
        out[name] = w
    return out


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """0 for a mamba or falcon_mamba config (nothing attends, no KV cache), else None."""
    return 0 if config.get("model_type") in MODEL_TYPES else None
