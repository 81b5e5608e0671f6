"""Jina BERT v2 at the loader edge: "jina-bert-v2" GGUFs as llama.cpp's converter writes
them (conversion/bert.py JinaBertV2Model) and src/models/bert.cpp reads them, and the Hub's
checkpoints (config.json model_type "bert", architectures JinaBertModel or
JinaBertForMaskedLM, as the converter recognises them) under JinaBertModel's names
(llmrun/models/jina_bert.py).

The converter writes BERT's keys (attention.layer_norm_epsilon, attention.causal false, a
token type count, the context length max_position_embeddings) and the tensors by gguf-py's
map: gated_layers whole as ffn_up (rows of the gate, then the up projection: llama.cpp's
GEGLU), wo as ffn_down, mlp.layernorm as layer_output_norm, layer_norm_q/k as
attn_q_norm/attn_k_norm. Files from before 2025 hold gated_layers split, the gate as
ffn_gate and the rest as ffn_up (llama.cpp then computes gelu(gate) * up): llmrun joins
them. llama.cpp biases the attention by ALiBi of max bias 8 whatever the file says.

jina-embeddings-v2-base-code's other layout (jinaai/jina-bert-v2-qk-post-norm's
modeling_bert.py: up_gated_layer, down_layer, layer_norm_1 and layer_norm_2) becomes the
model's names: down_layer is wo, layer_norm_2 mlp.layernorm, layer_norm_1 the second norm
after the attention (attn_norm_2 in a GGUF), and up_gated_layer is gated_layers with its
halves swapped: its modeling file (as text-embeddings-inference's JinaCodeBertLayer) takes
the first intermediate_size features as the up projection and the rest as the gate,
up * gelu(gate). The converter writes up_gated_layer whole as ffn_up, whose first half
llama.cpp then takes as the gate (its GEGLU): llmrun computes the published model there,
not llama.cpp's reading, swapping the halves of a code-layout file's whole ffn_up. Files
from before 2025 hold it split, the gate half as ffn_gate, as for the other models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES

from llmrun.errors import UnsupportedError
from llmrun.loading import bert

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "jina-bert-v2"
MODEL_TYPE = "jina_bert"  # llmrun's: the Hub's config.json says "bert"
HF_CLASSES = ("JinaBertModel", "JinaBertForMaskedLM")
_GATED = "mlp.gated_layers"
_SPLIT_GATE = "mlp.gate"  # an old file's ffn_gate, joined before the up rows
hf_name = bert.name_table(
    {
        MODEL_TENSOR.ATTN_Q: "attention.self.query",
        MODEL_TENSOR.ATTN_K: "attention.self.key",
        MODEL_TENSOR.ATTN_V: "attention.self.value",
        MODEL_TENSOR.ATTN_QKV: bert.FUSED_QKV[0],
        MODEL_TENSOR.ATTN_Q_NORM: "attention.self.layer_norm_q",
        MODEL_TENSOR.ATTN_K_NORM: "attention.self.layer_norm_k",
        MODEL_TENSOR.ATTN_OUT: "attention.output.dense",
        MODEL_TENSOR.ATTN_OUT_NORM: "attention.output.LayerNorm",
        MODEL_TENSOR.FFN_GATE: _SPLIT_GATE,
        MODEL_TENSOR.FFN_UP: _GATED,
        MODEL_TENSOR.FFN_DOWN: "mlp.wo",
        MODEL_TENSOR.LAYER_OUT_NORM: "mlp.layernorm",
        MODEL_TENSOR.ATTN_NORM_2: "layer_norm_1",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "embeddings.word_embeddings",
        MODEL_TENSOR.TOKEN_TYPES: "embeddings.token_type_embeddings",
        MODEL_TENSOR.TOKEN_EMBD_NORM: "embeddings.LayerNorm",
    },
    "encoder.layer",
)
# jina-embeddings-v2-base-code's modules -> the model's (the module's docstring).
_CODE_NAMES = {
    ".mlp.up_gated_layer.": f".{_GATED}.",
    ".mlp.down_layer.": ".mlp.wo.",
    ".layer_norm_2.": ".mlp.layernorm.",
}
# The Hub's tensors no encoder output needs: the MLM head, the pooler, buffers.
_DROPPED_PREFIXES = ("cls.", "pooler.")
_DROPPED = ("embeddings.position_ids", "embeddings.token_type_ids")


def hf_applies(config: dict[str, Any]) -> bool:
    """Whether a config.json is Jina BERT v2's (model_type "bert", a JinaBert class)."""
    classes = config.get("architectures") or []
    return config.get("model_type") == "bert" and any(c in HF_CLASSES for c in classes)


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], where: Any, weight_type: type
) -> tuple[dict[str, Any], dict]:
    """A Hub folder's config and weights as the model takes them: model_type jina_bert,
    q/k norms and the code model's second attention norm where the weights hold them, its
    layout renamed (up_gated_layer's halves swapped), the "bert." prefix, MLM head and
    pooler dropped. What the model does not compute (another feed-forward, position
    table, a classifier) is refused by name."""
    ffn = config.get("feed_forward_type", "original")
    if ffn != "geglu":
        raise UnsupportedError(
            f"{where}: feed_forward_type {ffn!r} is not supported in Jina BERT v2 models "
            "(supported: 'geglu')"
        )
    positions = config.get("position_embedding_type", "absolute")
    if positions != "alibi":
        raise UnsupportedError(
            f"{where}: position_embedding_type {positions!r} is not supported in Jina BERT v2 "
            "models (supported: 'alibi')"
        )
    out = {}
    for name, w in weights.items():
        name = name.removeprefix("bert.")
        if name.startswith(_DROPPED_PREFIXES) or name in _DROPPED:
            continue
        if name.startswith("classifier."):
            raise UnsupportedError(
                f"{where}: tensor {name!r} is a classifier (reranker) head, which llmrun "
                "does not support for Jina BERT v2"
            )
        for old, new in _CODE_NAMES.items():
            if old in name:
                if old == ".mlp.up_gated_layer.":
                    w = _swap_halves(w, weight_type)
                name = name.replace(old, new)
        out[name] = w
    qk_norm = any(".layer_norm_q." in name for name in out)
    norm_2 = any(".layer_norm_1." in name for name in out)
    config = {**config, "model_type": MODEL_TYPE, "qk_norm": qk_norm, "attention_norm_2": norm_2}
    return config, out


def _swap_halves(w: Any, weight_type: type) -> Any:
    """A [2 * width, hidden] matrix (float, or a GGUF's rows of blocks) with its two halves
    of rows swapped."""
    import torch

    half = w.tensor.shape[0] // 2
    return weight_type(torch.cat([w.tensor[half:], w.tensor[:half]]), w.ggml_type, w.shape)


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style jina_bert config from a "jina-bert-v2" GGUF, as llama.cpp reads it (the
    code model's layout where it has attn_norm_2); a feed-forward without a gate (llama.cpp's
    plain GELU) is refused."""
    config = bert.encoder_config(gg)
    layers, width = config["num_hidden_layers"], config["intermediate_size"]

    def tensor(kind: MODEL_TENSOR, layer: int) -> Any:
        return gg.tensors.get(TENSOR_NAMES[kind].format(bid=layer) + ".weight")

    for i in range(layers):
        up, gate = tensor(MODEL_TENSOR.FFN_UP, i), tensor(MODEL_TENSOR.FFN_GATE, i)
        rows = up.shape[0] if up is not None else None
        if rows != (width if gate is not None else 2 * width):
            raise UnsupportedError(
                f"{gg.path}: layer {i}'s ffn_up has {rows} rows"
                f"{' beside ffn_gate' if gate is not None else ''}; llmrun runs Jina BERT v2's "
                f"GEGLU feed-forward: ffn_up of {2 * width} rows (gate, then up), or ffn_gate "
                f"and ffn_up of {width}"
            )
    qk_norm = tensor(MODEL_TENSOR.ATTN_Q_NORM, 0) is not None
    norm_2 = tensor(MODEL_TENSOR.ATTN_NORM_2, 0) is not None
    return {
        "model_type": MODEL_TYPE,
        **config,
        "hidden_act": "gelu",
        "qk_norm": qk_norm,
        "attention_norm_2": norm_2,
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The file's weights as the model takes them (bert.gguf_weights: a fused attn_qkv
    split), an old file's ffn_gate and ffn_up rows joined into gated_layers (gate first), a
    code-layout file's whole ffn_up with its halves swapped (the module's docstring)."""
    import torch

    out = {}
    for name, w in weights.items():
        whole = f".{_GATED}." in name and name.replace(_GATED, _SPLIT_GATE) not in weights
        if whole and config.get("attention_norm_2"):
            out[name] = _swap_halves(w, weight_type)
            continue
        if f".{_SPLIT_GATE}." not in name:
            out.setdefault(name, w)
            continue
        up_name = name.replace(_SPLIT_GATE, _GATED)
        up = weights[up_name]
        if w.ggml_type != up.ggml_type or w.tensor.dtype != up.tensor.dtype:
            layer = name.split(".")[2]
            raise UnsupportedError(
                f"layer {layer}'s ffn_gate and ffn_up are stored as different types, which "
                "llmrun does not support (it joins them into one matrix, as gated_layers is)"
            )
        joined = torch.cat([w.tensor, up.tensor])
        out[up_name] = weight_type(joined, w.ggml_type, (2 * w.shape[0], *w.shape[1:]))
    return bert.gguf_weights(out, config, weight_type, *bert.FUSED_QKV)
