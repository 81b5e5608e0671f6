"""Falcon-H1 at the loader edge: "falcon-h1" GGUFs as llama.cpp's converter writes them
(conversion/falcon_h1.py FalconH1Model over mamba.py Mamba2Model) and llama.cpp reads
them (src/models/falcon-h1.cpp, mamba-base.cpp build_mamba2_layer).

What the converter does, undone here: every muP multiplier is folded into the weights
(the embeddings times embedding_multiplier, lm_head times lm_head_multiplier, q/v times
attention_in_multiplier, k times attention_in_multiplier * key_multiplier, o times
attention_out_multiplier, the mixer's in_proj times ssm_in_multiplier and its row
blocks z, x, B, C, dt each times their ssm_multipliers entry, out_proj times
ssm_out_multiplier, the feed-forward's gate and down times mlp_multipliers), so the
config takes them all as 1; the Mamba-2 tensors are stored as granitehybrid's
(granitehybrid.mamba2_weight undoes them); q/k rows are as they are (NEOX RoPE).
llama.cpp's mixer gates before its optional grouped norm (mamba_norm_before_gate
false; mamba_rms_norm where ssm_norm is in the file), reads no bias of in_proj or
out_proj and clamps no time step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading import granitehybrid
from llmrun.loading.gguf_io import ArchMetadata, layer_name

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH, MODEL_TYPE = "falcon-h1", "falcon_h1"


GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.final_layernorm",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
}
# GGUF module (after "blk.N.") -> HF module (after "model.layers.N."); the mixer's
# tensors are granitehybrid.LAYER_NAMES.
LAYER_NAMES = {
    layer_name(MODEL_TENSOR.ATTN_NORM): "input_layernorm",
    layer_name(MODEL_TENSOR.FFN_NORM): "pre_ff_layernorm",
    layer_name(MODEL_TENSOR.ATTN_Q): "self_attn.q_proj",
    layer_name(MODEL_TENSOR.ATTN_K): "self_attn.k_proj",
    layer_name(MODEL_TENSOR.ATTN_V): "self_attn.v_proj",
    layer_name(MODEL_TENSOR.ATTN_OUT): "self_attn.o_proj",
    layer_name(MODEL_TENSOR.FFN_GATE): "feed_forward.gate_proj",
    layer_name(MODEL_TENSOR.FFN_UP): "feed_forward.up_proj",
    layer_name(MODEL_TENSOR.FFN_DOWN): "feed_forward.down_proj",
}


# The converter writes the feed-forward norm without a ".weight": gguf-py maps the whole
# name "model.layers.N.pre_ff_layernorm.weight" (suffix included) to this arch's
# FFN_PRE_NORM, "blk.N.ffn_norm", and llama.cpp's falcon-h1 loader reads that name.
FFN_NORM_NAME = "ffn_norm"


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face key of a falcon-h1 GGUF tensor, or None if it is not one."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES and suffix == "weight":
        return f"{GLOBAL_NAMES[base]}.weight"
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    mixer = granitehybrid.LAYER_NAMES.get(parts[2])
    if mixer is not None and mixer.startswith("mamba."):
        return f"model.layers.{parts[1]}.{mixer}"
    if parts[2] == FFN_NORM_NAME:
        return f"model.layers.{parts[1]}.pre_ff_layernorm.weight"
    module, _, suffix = parts[2].rpartition(".")
    if module not in LAYER_NAMES or suffix not in ("weight", "bias"):
        return None
    return f"model.layers.{parts[1]}.{LAYER_NAMES[module]}.{suffix}"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable) -> dict[str, Any]:
    """The HF config.json dict of a falcon-h1 GGUF, its multipliers all 1 (folded into
    the weights). rope_from_gguf: gguf_config._rope_from_gguf."""
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or (hidden // heads if heads else None)
    inner = meta.require(Keys.SSM.INNER_SIZE)
    ssm_heads = meta.require(Keys.SSM.TIME_STEP_RANK)
    groups = meta.require(Keys.SSM.GROUP_COUNT)
    if not ssm_heads or inner % ssm_heads or not groups or ssm_heads % groups:
        raise ModelFormatError(
            f"{gg.path}: ssm.inner_size {inner} does not split into ssm.time_step_rank "
            f"{ssm_heads} Mamba-2 heads in ssm.group_count {groups} groups"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    embed = gg.tensors.get("token_embd.weight")
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": meta.get(Keys.LLM.VOCAB_SIZE) or (embed.shape[0] if embed else None),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gg.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in gg.tensors,
        "mamba_d_ssm": inner,
        "mamba_n_heads": ssm_heads,
        "mamba_d_head": inner // ssm_heads,
        "mamba_n_groups": groups,
        "mamba_d_state": meta.require(Keys.SSM.STATE_SIZE),
        "mamba_d_conv": meta.require(Keys.SSM.CONV_KERNEL),
        "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in gg.tensors,
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in gg.tensors,
        "mamba_norm_before_gate": False,
        "rope_parameters": rope_from_gguf(gg, meta, head_dim, context),
    }
    return config


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict:
    """A falcon-h1 GGUF's tensors as the model holds them: the Mamba-2 tensors in their HF
    shapes (granitehybrid.mamba2_weight), the rest as they are."""
    out = {}
    for name, w in weights.items():
        part = name.split(".", 3)[-1]  # after "model.layers.N."
        if name.startswith("model.layers.") and part.startswith("mamba."):
            out[name] = granitehybrid.mamba2_weight(
                name, part.removeprefix("mamba."), w, weight_type
            )
        else:
            out[name] = w
    return out
