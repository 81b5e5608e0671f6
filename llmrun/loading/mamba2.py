"""Mamba-2 at the loader edge: "mamba2" GGUFs as llama.cpp's converter writes them
(conversion/mamba.py Mamba2Model) and llama.cpp reads them (src/models/mamba2.cpp), and
the Hub's checkpoints under transformers' names (llmrun/models/mamba2.py).

The converter writes the SSM sizes (ssm.conv_kernel, inner_size, state_size,
time_step_rank: the heads, group_count), attention.layer_norm_rms_epsilon, a context
of 2^20 and zero feed-forward length and heads (unused); it stores A as -exp(A_log)
[heads, 1], D [heads, 1], the convolution squeezed to [channels, d_conv], the gated
norm's weight as [n_groups, inner / n_groups] (granitehybrid.mamba2_weight undoes
these) and dt_bias as ssm_dt.bias; the layer's norm is attn_norm. llama.cpp requires
the convolution's bias and reads no bias of in_proj or out_proj; the output matrix is
token_embd's where the file has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading import granitehybrid, nemotron_h
from llmrun.loading.gguf_io import ArchMetadata

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = MODEL_TYPE = "mamba2"
# Nemotron-H's GGUF names are Mamba-2's: attn_norm as the layer's norm, ssm_* as the
# mixer's, token_embd, output_norm and output as model.embeddings, model.norm_f, lm_head.
hf_name = nemotron_h.hf_name


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The HF config.json dict of a mamba2 GGUF, read as llama_model_mamba2's
    load_arch_hparams and the common load_hparams read it (every key it reads required)."""
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    inner = meta.require(Keys.SSM.INNER_SIZE)
    heads = meta.require(Keys.SSM.TIME_STEP_RANK)
    if not heads or inner % heads or not hidden or inner % hidden:
        raise ModelFormatError(
            f"{gg.path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
            f"{heads} (the Mamba-2 heads) and of the embedding length {hidden}"
        )
    embed = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    if embed is None:
        raise ModelFormatError(f"{gg.path}: tensor 'token_embd.weight' is missing")
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "vocab_size": embed.shape[0],
        "num_heads": heads,
        "head_dim": inner // heads,
        "expand": inner // hidden,
        "state_size": meta.require(Keys.SSM.STATE_SIZE),
        "n_groups": meta.require(Keys.SSM.GROUP_COUNT),
        "conv_kernel": meta.require(Keys.SSM.CONV_KERNEL),
        "use_conv_bias": True,  # llama.cpp requires ssm_conv1d.bias
        "use_bias": False,  # and reads no bias of ssm_in or ssm_out
        "layer_norm_epsilon": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "tie_word_embeddings": f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight" not in gg.tensors,
    }


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict:
    """A mamba2 GGUF's tensors as the model holds them: the mixers' A, D, convolution and
    gated norm in their HF shapes (granitehybrid.mamba2_weight)."""
    out = {}
    for name, w in weights.items():
        part = name.split(".", 3)[-1]  # after "model.layers.N."
        if name.startswith("model.layers.") and part.startswith("mixer."):
            w = granitehybrid.mamba2_weight(name, part.removeprefix("mixer."), w, weight_type)
        out[name] = w
    return out


def hf_weights(weights: dict[str, Any]) -> dict:
    """A Hub checkpoint's tensors under llmrun's names: backbone. as model. (the older
    checkpoints' embedding. as embeddings., as transformers' load hook renames it)."""
    out = {}
    for name, w in weights.items():
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        out[name.replace("model.embedding.", "model.embeddings.")] = w
    return out


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """0 for a mamba2 config (nothing attends, no KV cache), else None
    (llmrun.loading.inspect)."""
    return 0 if config.get("model_type") == MODEL_TYPE else None
