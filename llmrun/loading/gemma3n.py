"""Gemma 3n checkpoints: Hugging Face folders (the language model of a
Gemma3nForConditionalGeneration, or a text-only one) and GGUFs of arch "gemma3n" as
llama.cpp's converter writes them (conversion/gemma.py Gemma3NModel: Gemma 3's keys
with the norms as they are, not shifted by 1; the AltUp stream count, active stream,
per-layer input width, shared KV layers, each layer's activation sparsity as its
cutoff's std multiplier (icdf(sparsity), -inf where dense) and window flags as keys;
the three AltUp projections and the three unembedding projections each stacked into
one [3, hidden, hidden] tensor; the embeddings, per-layer ones too, padded with zero
rows to vocab_size; the vision and audio towers left out).

Both formats hold keys and values for every layer, the sharing layers' too, which
neither transformers nor llama.cpp reads: they are dropped here.

Where a GGUF leaves a key out, llmrun takes llama.cpp's value (src/models/gemma3n.cpp,
src/llama-hparams.h, src/models/models.h), which llama.cpp also takes whatever the file
says for most of them: 4 streams, stream 0 active, per-layer inputs 256 wide, the first
20 layers computing keys and values, the first 10 layers sparse at 0.95, every fifth
layer global, a final soft-cap of 30 and a sliding RoPE base of 10000.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = "gemma3n"
MODEL_TYPE = "gemma3n_text"
MODEL_TYPES = ("gemma3n", "gemma3n_text")  # multimodal, text-only
SWA_PATTERN = 5  # load_swa_pattern(ml, 5): every fifth layer global
KV_LAYERS = 20  # hparams.n_layer_kv_from_start
ALTUP_INPUTS = 4  # hparams.n_altup
ALTUP_ACTIVE = 0  # hparams.i_altup_act
PER_LAYER_WIDTH = 256  # hparams.n_embd_altup
SPARSE_LAYERS = 10  # n_layer_sparsity
STD_MULTIPLIER = 1.6448533535003662  # f_sparsity_std_mul: normal icdf(0.95)
FINAL_SOFTCAP = 30.0  # f_final_logit_softcapping
ROPE_BASE_SWA = 10000.0  # rope_freq_base_train_swa

# GGUF name (without ".weight") -> HF key, for the model-wide tensors.
_GLOBAL = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens.weight",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head.weight",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.norm.weight",
    TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_TOKEN_EMBD]: "model.embed_tokens_per_layer.weight",
    TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_MODEL_PROJ]: "model.per_layer_model_projection.weight",
    TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_PROJ_NORM]: "model.per_layer_projection_norm.weight",
}
# The stacked AltUp projections -> the HF ModuleList they split into (gguf_weights).
STACKS = {
    TENSOR_NAMES[MODEL_TENSOR.ALTUP_PROJ]: "model.altup_projections",
    TENSOR_NAMES[MODEL_TENSOR.ALTUP_UNEMBD_PROJ]: "model.altup_unembed_projections",
}
# A layer's GGUF tensor -> its HF key within model.layers.N.
_LAYER = {
    MODEL_TENSOR.ATTN_Q: "self_attn.q_proj.weight",
    MODEL_TENSOR.ATTN_K: "self_attn.k_proj.weight",
    MODEL_TENSOR.ATTN_V: "self_attn.v_proj.weight",
    MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj.weight",
    MODEL_TENSOR.ATTN_Q_NORM: "self_attn.q_norm.weight",
    MODEL_TENSOR.ATTN_K_NORM: "self_attn.k_norm.weight",
    MODEL_TENSOR.ATTN_NORM: "input_layernorm.weight",
    MODEL_TENSOR.ATTN_POST_NORM: "post_attention_layernorm.weight",
    MODEL_TENSOR.FFN_PRE_NORM: "pre_feedforward_layernorm.weight",
    MODEL_TENSOR.FFN_POST_NORM: "post_feedforward_layernorm.weight",
    MODEL_TENSOR.FFN_GATE: "mlp.gate_proj.weight",
    MODEL_TENSOR.FFN_UP: "mlp.up_proj.weight",
    MODEL_TENSOR.FFN_DOWN: "mlp.down_proj.weight",
    MODEL_TENSOR.PER_LAYER_INP_GATE: "per_layer_input_gate.weight",
    MODEL_TENSOR.PER_LAYER_PROJ: "per_layer_projection.weight",
    MODEL_TENSOR.PER_LAYER_POST_NORM: "post_per_layer_input_norm.weight",
    MODEL_TENSOR.ALTUP_CORRECT_COEF: "altup.correction_coefs.weight",
    # The converter adds ".weight" to the parameter's name (Gemma3NModel.filter_tensors).
    MODEL_TENSOR.ALTUP_CORRECT_SCALE: "altup.correct_output_scale",
    MODEL_TENSOR.ALTUP_PREDICT_COEF: "altup.prediction_coefs.weight",
    MODEL_TENSOR.ALTUP_ROUTER: "altup.modality_router.weight",
    MODEL_TENSOR.ALTUP_ROUTER_NORM: "altup.router_norm.weight",
    MODEL_TENSOR.LAUREL_L: "laurel.linear_left.weight",
    MODEL_TENSOR.LAUREL_R: "laurel.linear_right.weight",
    MODEL_TENSOR.LAUREL_POST_NORM: "laurel.post_laurel_norm.weight",
}
_LAYER_NAMES = {TENSOR_NAMES[t].split(".")[-1]: hf for t, hf in _LAYER.items()}
# What a sharing layer has in both formats and computes with in neither.
_UNUSED_KV = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")


def hf_name(gguf_name: str) -> str | None:
    """The HF key of a gemma3n GGUF tensor (a stack's: its ModuleList's name + ".weight",
    split by gguf_weights), or None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        return None
    if base in _GLOBAL:
        return _GLOBAL[base]
    if base in STACKS:
        return f"{STACKS[base]}.weight"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    name = _LAYER_NAMES.get(parts[2])
    return None if name is None else f"model.layers.{parts[1]}.{name}"


def finish_config(
    gg: GGUFFile,
    config: dict[str, Any],
    meta: ArchMetadata,
    rope_from_gguf: Callable[..., dict[str, Any]],
    layer_types: Callable[..., list[str]],
) -> dict[str, Any]:
    """Gemma 3n's fields of the HF-style config that config_from_gguf built
    (`rope_from_gguf` and `layer_types` are gguf_config's readers of the RoPE keys and of
    llama.cpp's window pattern)."""
    layers = config["num_hidden_layers"]
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    if not window:
        # llama.cpp refuses the file too (a required key of gemma3n's hparams).
        raise ModelFormatError(
            f"{gg.path}: {Keys.Attention.SLIDING_WINDOW.format(arch=ARCH)} is missing or 0; "
            "Gemma 3n's local layers need their window"
        )
    shared = meta.get(Keys.Attention.SHARED_KV_LAYERS, max(layers - KV_LAYERS, 0))
    scales = meta.get(Keys.LLM.ACTIVATION_SPARSITY_SCALE)
    if scales is None:
        scales = [STD_MULTIPLIER if i < SPARSE_LAYERS else -math.inf for i in range(layers)]
    rope = rope_from_gguf(gg, meta, config["head_dim"], config["max_position_embeddings"])
    local = {"rope_type": "default", "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, ROPE_BASE_SWA)}
    config.update(
        model_type=MODEL_TYPE,
        hidden_activation="gelu_pytorch_tanh",  # its graph's ggml_gelu
        sliding_window=window,
        layer_types=layer_types(gg, meta, layers, SWA_PATTERN),
        rope_parameters={"full_attention": rope, "sliding_attention": local},
        final_logit_softcapping=meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, FINAL_SOFTCAP),
        altup_num_inputs=meta.get(Keys.LLM.ALTUP_NUM_INPUTS, ALTUP_INPUTS),
        altup_active_idx=meta.get(Keys.LLM.ALTUP_ACTIVE_IDX, ALTUP_ACTIVE),
        altup_correct_scale=True,  # llama.cpp always scales (the tensor is always written)
        hidden_size_per_layer_input=meta.get(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, PER_LAYER_WIDTH),
        num_kv_shared_layers=shared,
        activation_sparsity_std_multipliers=[float(s) for s in scales],
        laurel_rank=_rows(gg, f"blk.0.{TENSOR_NAMES[MODEL_TENSOR.LAUREL_L].split('.')[-1]}"),
        # The converter pads the per-layer table to vocab_size with zero rows, which
        # llama.cpp then looks up: its rows are the table's.
        vocab_size_per_layer_input=_rows(gg, TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_TOKEN_EMBD]),
    )
    return config


def _rows(gg: GGUFFile, name: str) -> int:
    """The first (torch) dimension of tensor NAME.weight, which the model needs."""
    info = gg.tensors.get(f"{name}.weight")
    if info is None:
        raise ModelFormatError(f"{gg.path}: tensor {name}.weight is missing; gemma3n needs it")
    return int(info.shape[0])


def _drop_unused_kv(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """`weights` without the sharing layers' key and value tensors."""
    text = config.get("text_config") or config
    layers = int(text["num_hidden_layers"])
    first = layers - int(text.get("num_kv_shared_layers", 15))  # transformers' default
    unused = tuple(f"model.layers.{i}.{n}" for i in range(first, layers) for n in _UNUSED_KV)
    return {name: w for name, w in weights.items() if not name.startswith(unused)}


def hf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face folder's language-model weights (HF names) as the model has them."""
    return _drop_unused_kv(weights, config)


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight: type) -> dict[str, Any]:
    """A GGUF's weights (HF names) as the model has them: the stacks split into their
    projections (2-D views, quantized rows as they are), the unused keys and values
    dropped; `weight` is the loader's Weight."""
    hidden, count = config["hidden_size"], config["altup_num_inputs"] - 1
    out = _drop_unused_kv(weights, config)
    for module in STACKS.values():
        stack = out.pop(f"{module}.weight", None)
        if stack is None:
            raise ModelFormatError(f"a gemma3n GGUF needs the stacked {module}")
        if stack.shape != (count, hidden, hidden):
            raise ModelFormatError(
                f"tensor {module} has shape {list(stack.shape)}, but the metadata implies "
                f"{[count, hidden, hidden]} ({count + 1} AltUp streams of {hidden})"
            )
        # [count * hidden, row] (quantized: row bytes) or [count, hidden, hidden]
        rows = stack.tensor.view(count, hidden, -1)
        for i in range(count):
            out[f"{module}.{i}.weight"] = weight(rows[i], stack.ggml_type, (hidden, hidden))
    return out
