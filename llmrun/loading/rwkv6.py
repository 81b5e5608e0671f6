"""RWKV-6 at the loader edge: "rwkv6" GGUFs as llama.cpp's converter writes them from the
Hugging Face port's Rwkv6ForCausalLM folders (conversion/rwkv.py Rwkv6Model) and llama.cpp
reads them (src/models/rwkv6.cpp, rwkv6-base.cpp), under that port's names
(llmrun/models/rwkv6.py).

What the converter does, undone here: the five ddlerp mixes time_maa_w, k, v, r, g are
stacked into one time_mix_lerp_fused [5, 1, 1, hidden]; the ddlerp's and the decay's
low-rank matrices are transposed (time_maa_w2 [5, extra, hidden] stored as [5, hidden,
extra]); the mixes and time_decay are squeezed to [hidden]; pre_ln is token_embd_norm. The
output matrices stay divided by 2^(block // rescale_every): the model halves its hidden
state as llama.cpp does (rescale_every from rescale_every_n_layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, layer_name, mapped_name

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "rwkv6"
MODEL_TYPE = "rwkv6"
_FUSED = "attention.lerp_fused"

GLOBAL_NAMES = {
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight": "model.embeddings.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD_NORM]}.weight": "model.layers.0.pre_ln.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD_NORM]}.bias": "model.layers.0.pre_ln.bias",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]}.weight": "model.ln_out.weight",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]}.bias": "model.ln_out.bias",
    f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight": "lm_head.weight",
}
# GGUF tensor (after "blk.N.", with its suffix) -> the port's key (after "model.layers.N.").
LAYER_NAMES = {
    f"{layer_name(MODEL_TENSOR.ATTN_NORM)}.weight": "ln1.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_NORM)}.bias": "ln1.bias",
    f"{layer_name(MODEL_TENSOR.ATTN_NORM_2)}.weight": "ln2.weight",
    f"{layer_name(MODEL_TENSOR.ATTN_NORM_2)}.bias": "ln2.bias",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_LERP_X)}.weight": "attention.time_maa_x",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_LERP_FUSED)}.weight": _FUSED,
    f"{layer_name(MODEL_TENSOR.TIME_MIX_W1)}.weight": "attention.time_maa_w1",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_W2)}.weight": "attention.time_maa_w2",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_DECAY)}.weight": "attention.time_decay",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_DECAY_W1)}.weight": "attention.time_decay_w1",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_DECAY_W2)}.weight": "attention.time_decay_w2",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_FIRST)}.weight": "attention.time_faaaa",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_RECEPTANCE)}.weight": "attention.receptance.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_KEY)}.weight": "attention.key.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_VALUE)}.weight": "attention.value.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_GATE)}.weight": "attention.gate.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_OUTPUT)}.weight": "attention.output.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_LN)}.weight": "attention.ln_x.weight",
    f"{layer_name(MODEL_TENSOR.TIME_MIX_LN)}.bias": "attention.ln_x.bias",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_LERP_K)}.weight": "feed_forward.time_maa_k",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_LERP_R)}.weight": "feed_forward.time_maa_r",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_KEY)}.weight": "feed_forward.key.weight",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_RECEPTANCE)}.weight": "feed_forward.receptance.weight",
    f"{layer_name(MODEL_TENSOR.CHANNEL_MIX_VALUE)}.weight": "feed_forward.value.weight",
}
# Read as float and reshaped here (llama.cpp's quantizer keeps them so).
_RESHAPED = (
    "time_maa_x", _FUSED, "time_maa_w1", "time_maa_w2", "time_decay", "time_decay_w1",
    "time_decay_w2", "time_faaaa", "time_maa_k", "time_maa_r",
)  # fmt: skip


def hf_name(gguf_name: str) -> str | None:
    """The port's key of an "rwkv6" GGUF tensor (the fused mixes under a name of their own,
    split by gguf_weights), or None if it has none."""
    return mapped_name(gguf_name, GLOBAL_NAMES, LAYER_NAMES, "model.layers.")


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The config.json dict of an "rwkv6" GGUF, read as llama_model_rwkv6 reads it."""
    meta = ArchMetadata.of(gg, ARCH)
    embed = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    if embed is None:
        raise ModelFormatError(f"{gg.path}: tensor token_embd.weight is missing")
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "head_size": meta.require(Keys.WKV.HEAD_SIZE),
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "layer_norm_epsilon": meta.require(Keys.Attention.LAYERNORM_EPS),
        "rescale_every": meta.get(Keys.LLM.RESCALE_EVERY_N_LAYERS, 0),
        "time_mix_extra_dim": meta.require(Keys.LLM.TIME_MIX_EXTRA_DIM),
        "time_decay_extra_dim": meta.require(Keys.LLM.TIME_DECAY_EXTRA_DIM),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": False,
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """An "rwkv6" GGUF's tensors as the model holds them: the mixes apart and [1, 1, hidden],
    the low-rank matrices as x @ W takes them; `weight_type` wraps a tensor (loader.Weight)."""
    hidden = config["hidden_size"]
    from llmrun.models.rwkv6 import MIXES  # torch: not imported where show reads a config

    out = {}
    for name, w in weights.items():
        part = name.rsplit(".", 1)[-1]
        if part in _RESHAPED and w.ggml_type is not None:
            raise ModelFormatError(
                f"tensor {name} is quantized ({w.ggml_type.name}); llama.cpp keeps RWKV-6's "
                "token-shift mixes, decay and low-rank matrices in float"
            )
        t = w.tensor
        if name.endswith(_FUSED):
            mixes = t.reshape(len(MIXES), hidden)
            block = name.removesuffix(_FUSED)
            for i, mix in enumerate(MIXES):
                shape = (1, 1, hidden)
                out[f"{block}attention.time_maa_{mix}"] = weight_type(
                    mixes[i].view(shape), None, shape
                )
            continue
        if part in ("time_maa_x", "time_decay", "time_maa_k", "time_maa_r"):
            t = t.reshape(1, 1, hidden)
        elif part in ("time_maa_w1", "time_decay_w1", "time_decay_w2"):
            t = t.t()
        elif part == "time_maa_w2":
            t = t.permute(0, 2, 1)
        else:
            out[name] = w
            continue
        out[name] = weight_type(t.contiguous(), None, tuple(t.shape))
    return out


def hf_checkpoint(config: dict[str, Any], weights: dict[str, Any]) -> tuple[dict, dict]:
    """A Hugging Face port's folder (RWKV/v6-Finch-*-HF, Rwkv6ForCausalLM: rwkv.blocks.N.*,
    head) under the model's names. Its matrices are not divided (the port divides them
    only when it runs in half precision), so nothing is halved either: rescale_every 0."""
    out = {}
    for name, w in weights.items():
        if name == "head.weight":
            out["lm_head.weight"] = w
        elif name.startswith("rwkv."):
            out["model." + name.removeprefix("rwkv.").replace("blocks.", "layers.", 1)] = w
        else:
            raise ModelFormatError(f"tensor {name} is not part of an RWKV-6 checkpoint")
    # The low-rank sizes, which the port's config.json does not name (32 and 64 below
    # hidden 4096, 64 and 128 at 4096), from the first block's matrices.
    mix = out.get("model.layers.0.attention.time_maa_w2")  # [mixes, extra, hidden]
    decay = out.get("model.layers.0.attention.time_decay_w1")
    if mix is None or decay is None:
        raise ModelFormatError("an RWKV-6 checkpoint without time_maa_w2 or time_decay_w1")
    sizes = {
        "time_mix_extra_dim": mix.tensor.shape[1],
        "time_decay_extra_dim": decay.tensor.shape[1],
    }
    return {**config, **sizes, "rescale_every": 0}, out
