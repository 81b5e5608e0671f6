"""Nomic BERT at the loader edge: "nomic-bert" GGUFs as llama.cpp's converter writes them
(conversion/bert.py NomicBertModel) and src/models/bert.cpp reads them, and the Hub's
checkpoints (nomic-ai/nomic-embed-text-v1.5: its own config fields and module names)
under transformers 5's names (llmrun/models/nomic_bert.py).

The converter reads only the Hub's files: it requires a post-norm, bias-free SwiGLU model
with RoPE over whole heads, not interleaved and not scaled; writes TextModel's keys (its
context length the trained one, 2048 for v1 and v1.5), rope.freq_base from
rotary_emb_base, attention.layer_norm_epsilon, attention.causal false, a token type count;
keeps Wqkv fused (attn_qkv: rows of queries, keys, values), fc11 as ffn_up and fc12 as
ffn_gate. llama.cpp turns queries and keys by NEOX RoPE (half-split), base 10000 where the
file names none, and computes silu(gate(x)) * up(x).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import bert

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "nomic-bert"
MODEL_TYPE = "nomic_bert"
ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train where the file gives none
FUSED_QKV = ("self_attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
hf_name = bert.name_table(
    {
        MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
        MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
        MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
        MODEL_TENSOR.ATTN_QKV: FUSED_QKV[0],
        MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
        MODEL_TENSOR.ATTN_OUT_NORM: "post_attention_layernorm",
        MODEL_TENSOR.FFN_UP: "mlp.up_proj",
        MODEL_TENSOR.FFN_GATE: "mlp.gate_proj",
        MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
        MODEL_TENSOR.LAYER_OUT_NORM: "post_mlp_layernorm",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "embeddings.word_embeddings",
        MODEL_TENSOR.TOKEN_TYPES: "embeddings.token_type_embeddings",
        MODEL_TENSOR.TOKEN_EMBD_NORM: "embeddings.LayerNorm",
    },
    "layers",
)
# The Hub's config fields -> transformers 5's.
_HUB_FIELDS = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_inner": "intermediate_size",
    "layer_norm_epsilon": "layer_norm_eps",
    "rotary_emb_base": "rope_theta",
}
# The Hub's settings llmrun's model (and llama.cpp's converter) computes only one way:
# field -> (the value it takes, what another value would be).
_HUB_FIXED = {
    "activation_function": ("swiglu", "another feed-forward activation"),
    "prenorm": (False, "pre-norm blocks"),
    "causal": (False, "causal attention"),
    "qkv_proj_bias": (False, "attention biases"),
    "mlp_fc1_bias": (False, "feed-forward biases"),
    "mlp_fc2_bias": (False, "feed-forward biases"),
    "rotary_emb_fraction": (1.0, "RoPE on part of each head"),
    "rotary_emb_interleaved": (False, "interleaved RoPE"),
    "rotary_emb_scale_base": (None, "xPos RoPE scaling"),
    "rotary_scaling_factor": (None, "dynamic NTK RoPE scaling"),
    "use_rms_norm": (False, "RMSNorm"),
    "parallel_block": (False, "parallel attention and feed-forward"),
    "moe_every_n_layers": (None, "experts (nomic-embed-text-v2-moe)"),
}
# The Hub's module names -> transformers 5's (its conversion_mapping for nomic_bert).
_HUB_NAMES = (
    ("emb_ln.", "embeddings.LayerNorm."),
    ("encoder.layers.", "layers."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".mlp.fc11.", ".mlp.up_proj."),
    (".mlp.fc12.", ".mlp.gate_proj."),
    (".mlp.fc2.", ".mlp.down_proj."),
    (".norm1.", ".post_attention_layernorm."),
    (".norm2.", ".post_mlp_layernorm."),
)
_HUB_QKV = ".attn.Wqkv."


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style nomic_bert config from a "nomic-bert" GGUF, as llama.cpp reads it;
    RoPE scaling, which its graph would apply and the models never have, is refused."""
    arch = gg.architecture
    scaling = gg.metadata.get(Keys.Rope.SCALING_TYPE.format(arch=arch), "none")
    if scaling not in ("none", None):
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.SCALING_TYPE.format(arch=arch)} is {scaling!r}; "
            "nomic-bert models have unscaled RoPE"
        )
    theta = gg.metadata.get(Keys.Rope.FREQ_BASE.format(arch=arch), ROPE_BASE)
    return {
        "model_type": MODEL_TYPE,
        **bert.encoder_config(gg),
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The file's weights as the model takes them (bert.gguf_weights: attn_qkv split)."""
    return bert.gguf_weights(weights, config, weight_type, *FUSED_QKV)


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], folder: Path, weight_type: type
) -> tuple[dict[str, Any], dict]:
    """A folder's config and weights as transformers 5 reads them: the Hub's config fields
    (nomic-ai's NomicBertConfig: n_embd, ...) renamed, and the Hub's module names, which
    transformers 5 also writes (its conversion mapping, reversed on saving)."""
    if "n_embd" in config:
        config = hub_config(config, folder / "config.json")
    return config, hub_weights(weights, config, weight_type)


def hub_config(config: dict[str, Any], where: Any) -> dict[str, Any]:
    """The Hub's config as transformers 5's NomicBertConfig: fields renamed, the context
    the trained one (max_trained_positions, as llama.cpp's converter takes it), SwiGLU as
    silu; a setting the model does not compute is refused by name."""
    for name, (value, what) in _HUB_FIXED.items():
        if config.get(name, value) != value:
            raise UnsupportedError(
                f"{where}: {name} is {config[name]!r}: {what} is not supported in nomic_bert models"
            )
    out = {k: v for k, v in config.items() if k not in _HUB_FIELDS}
    out.update({new: config[old] for old, new in _HUB_FIELDS.items() if old in config})
    out["hidden_act"] = "silu"
    out["max_position_embeddings"] = config.get("max_trained_positions") or config.get(
        "n_positions"
    )
    return out


def hub_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The Hub's tensors under transformers 5's names, Wqkv's rows split into the queries,
    keys and values (views of them)."""
    hidden = config["hidden_size"]
    out = {}
    for name, w in weights.items():
        for old, new in _HUB_NAMES:
            name = name.replace(old, new) if old in name else name
        if _HUB_QKV not in name:
            out[name] = w
            continue
        if w.shape[0] != 3 * hidden:
            raise ModelFormatError(
                f"{name} has {w.shape[0]} rows, but the config implies {3 * hidden}"
            )
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            split = name.replace(_HUB_QKV, f".self_attn.{part}.")
            out[split] = weight_type(w.tensor[i * hidden : (i + 1) * hidden])
    return out
