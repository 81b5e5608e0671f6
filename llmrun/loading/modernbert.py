"""ModernBERT at the loader edge: "modern-bert" GGUFs as llama.cpp's converter writes them
(conversion/bert.py ModernBertModel) and src/models/modern-bert.cpp reads them, and the
Hub's checkpoints (ModernBertForMaskedLM's "model." prefix and MLM head) under
ModernBertModel's names (llmrun/models/modernbert.py).

The converter writes TextModel's keys (norm_eps as attention.layer_norm_rms_epsilon,
where llama.cpp's loader looks for attention.layer_norm_epsilon: llmrun reads either;
rope.freq_base the global layers' base,
rope.freq_base_swa the local ones'), attention.layer_norm_epsilon, attention.causal false,
sliding_window = local_attention and sliding_window_pattern = global_attn_every_n_layers
where the config has it, vocab_size, hidden_activation; the tensors as they are, the
"model." prefix stripped. llama.cpp reads: a window only where sliding_window is given and
positive (else every layer global), layer i local unless i % pattern == 0 (pattern 3 where
the file gives none, or a per-layer array), a query seeing keys within sliding_window / 2
either way; RoPE (NEOX) of base 10000 for either kind where the file names none; GEGLU
unless hidden_activation names SwiGLU; LayerNorms and linears without biases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import bert
from llmrun.loading.gguf_io import ArchMetadata

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "modern-bert"
MODEL_TYPE = "modernbert"
ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train and rope_freq_base_train_swa
SWA_PATTERN = 3  # load_swa_pattern(ml, 3, true): layer 0 global, then every third
# hidden_activation -> ModernBERT's activation: llama.cpp's LLM_FFN_OP_TYPES_FROM_STRING
# GEGLU and SwiGLU names (its ReLU ones llmrun refuses).
ACTIVATIONS = {"gelu": "gelu", "geglu": "gelu", "silu": "silu", "swish": "silu", "swiglu": "silu"}
hf_name = bert.name_table(
    {
        MODEL_TENSOR.ATTN_NORM: "attn_norm",
        MODEL_TENSOR.ATTN_QKV: "attn.Wqkv",
        MODEL_TENSOR.ATTN_OUT: "attn.Wo",
        MODEL_TENSOR.FFN_NORM: "mlp_norm",
        MODEL_TENSOR.FFN_UP: "mlp.Wi",
        MODEL_TENSOR.FFN_DOWN: "mlp.Wo",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "embeddings.tok_embeddings",
        MODEL_TENSOR.TOKEN_EMBD_NORM: "embeddings.norm",
        MODEL_TENSOR.OUTPUT_NORM: "final_norm",
    },
    "layers",
)
_HEADS = tuple(
    TENSOR_NAMES[t] for t in (MODEL_TENSOR.CLS, MODEL_TENSOR.CLS_OUT, MODEL_TENSOR.CLS_NORM)
)
# The Hub's MLM head (ModernBertForMaskedLM), which an encoder's output leaves out.
_DROPPED_PREFIXES = ("head.", "decoder.")


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style modernbert config from a "modern-bert" GGUF, as llama.cpp reads it."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    config = bert.encoder_config(gg, token_types=False, heads=_HEADS, rms_epsilon=True)
    config["norm_eps"] = config.pop("layer_norm_eps")
    layers = config["num_hidden_layers"]
    window = meta.get(Keys.Attention.SLIDING_WINDOW) or 0
    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN, SWA_PATTERN)
    if not window:
        local = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelFormatError(
                f"{path}: {Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)} lists "
                f"{len(pattern)} layers, but the model has {layers}"
            )
        local = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and pattern >= 0:
        local = [pattern == 0 or i % pattern != 0 for i in range(layers)]
    else:
        raise ModelFormatError(
            f"{path}: {Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)} is "
            f"{pattern!r}, not a layer count or a list of flags"
        )
    act = meta.get("{arch}.hidden_activation", "gelu")
    if act not in ACTIVATIONS:
        raise UnsupportedError(
            f"{path}: {arch}.hidden_activation {act!r} is not supported "
            f"(supported: {', '.join(ACTIVATIONS)})"
        )
    scaling = meta.get(Keys.Rope.SCALING_TYPE, "none")
    if scaling not in ("none", None):
        raise UnsupportedError(f"{path}: RoPE scaling {scaling!r} is not supported in {arch}")
    return {
        "model_type": MODEL_TYPE,
        **config,
        "vocab_size": meta.get(Keys.LLM.VOCAB_SIZE) or config["vocab_size"],
        "hidden_activation": ACTIVATIONS[act],
        "local_attention": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in local],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": meta.get(Keys.Rope.FREQ_BASE, ROPE_BASE),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, ROPE_BASE),
            },
        },
    }


def hf_weights(weights: dict[str, Any]) -> dict:
    """A Hub checkpoint's tensors under ModernBertModel's names: without the "model."
    prefix and the MLM head; a classifier (a reranker's) is refused."""
    out = {}
    for name, w in weights.items():
        if name.startswith("classifier."):
            raise UnsupportedError(
                f"tensor {name!r} is a classifier (reranker) head, which llmrun does not support"
            )
        if name.startswith(_DROPPED_PREFIXES):
            continue
        out[name.removeprefix("model.")] = w
    return out
