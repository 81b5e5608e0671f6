"""BERT-family encoders at the loader edge: "bert" GGUFs (BERT, RoBERTa and XLM-RoBERTa
alike) as llama.cpp's converter writes them (conversion/bert.py BertModel, RobertaModel,
XLMRobertaModel) and src/models/bert.cpp reads them, and the Hub's checkpoints under
BertModel's names (llmrun/models/bert.py).

The converter writes TextModel's shape keys, attention.layer_norm_epsilon and
attention.causal false (llama.cpp requires the epsilon, the context length and a nonzero
tokenizer.ggml.token_type_count); it drops the pooler, the MLM heads and position_ids,
strips a "bert." or "roberta." prefix, and for RoBERTa cuts the position table's first
padding_idx + 1 rows (and as many from the context length), so a file's positions start at
0. llama.cpp adds token_types' row 0 where the file has the tensor (nothing where not) and
attends to every token of a sequence; its GELU is the tanh approximation, the models'
(transformers' "gelu") the exact one, which llmrun computes.

Cross-encoders (*ForSequenceClassification, one label: rerankers): the Hub's BERT keeps its
pooler (dense + tanh) and a `classifier` projection, RoBERTa and XLM-RoBERTa a
`classifier.dense` and `classifier.out_proj`; the model holds both shapes as `classifier.dense`
and `classifier.out_proj`. The converter writes `cls` (classifier.dense) and `cls.output`
(out_proj; BERT's `classifier`), but drops BERT's pooler: such a file scores out_proj(h)
without the dense + tanh, as llama.cpp's rank pooling then computes (llama-graph.cpp,
build_pooling: tanh(cls h) where the file has cls, then cls.output).

Also the helpers nomic-bert's files share (loading/nomic_bert.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import reranker
from llmrun.loading.gguf_io import ArchMetadata

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = MODEL_TYPE = "bert"
# config.json model types of the Hub's BERT-family checkpoints.
HF_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
# Those whose positions start past the padding token's (create_position_ids_from_input_ids).
OFFSET_POSITION_TYPES = ("roberta", "xlm-roberta")
_POSITIONS = "embeddings.position_embeddings.weight"
_LAYER = {
    MODEL_TENSOR.ATTN_Q: "attention.self.query",
    MODEL_TENSOR.ATTN_K: "attention.self.key",
    MODEL_TENSOR.ATTN_V: "attention.self.value",
    MODEL_TENSOR.ATTN_QKV: "attention.self.qkv",  # fused by the converter's --fuse-qkv
    MODEL_TENSOR.ATTN_OUT: "attention.output.dense",
    MODEL_TENSOR.ATTN_OUT_NORM: "attention.output.LayerNorm",
    MODEL_TENSOR.FFN_UP: "intermediate.dense",
    MODEL_TENSOR.FFN_DOWN: "output.dense",
    MODEL_TENSOR.LAYER_OUT_NORM: "output.LayerNorm",
}
_GLOBAL = {
    MODEL_TENSOR.TOKEN_EMBD: "embeddings.word_embeddings",
    MODEL_TENSOR.POS_EMBD: "embeddings.position_embeddings",
    MODEL_TENSOR.TOKEN_TYPES: "embeddings.token_type_embeddings",
    MODEL_TENSOR.TOKEN_EMBD_NORM: "embeddings.LayerNorm",
    MODEL_TENSOR.CLS: "classifier.dense",
    MODEL_TENSOR.CLS_OUT: "classifier.out_proj",
}
# The fused attn_qkv's module and the projections it holds, in the order of its rows.
FUSED_QKV = (
    "attention.self.qkv",
    ("attention.self.query", "attention.self.key", "attention.self.value"),
)
# A classifier (reranker) head: llama.cpp's cls, cls.output.
_HEADS = (TENSOR_NAMES[MODEL_TENSOR.CLS], TENSOR_NAMES[MODEL_TENSOR.CLS_OUT])
# The Hub's tensors no encoder output needs: the pooler, the MLM and NSP heads, buffers.
_DROPPED_PREFIXES = ("pooler.", "cls.", "lm_head.")
_DROPPED = ("embeddings.position_ids", "embeddings.token_type_ids")


def name_table(layer: dict, names: dict, layers: str) -> Callable[[str], str | None]:
    """hf_name for an encoder family: `layer` maps blk.N.<MODEL_TENSOR> to
    `layers`.N.<module>, `names` the whole-model tensors to theirs; anything else is None."""
    modules = {TENSOR_NAMES[t].split(".")[-1]: module for t, module in layer.items()}
    whole = {TENSOR_NAMES[t]: module for t, module in names.items()}

    def hf_name(gguf_name: str) -> str | None:
        base, _, suffix = gguf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        if base in whole:
            return f"{whole[base]}.{suffix}"
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in modules:
            return f"{layers}.{parts[1]}.{modules[parts[2]]}.{suffix}"
        return None

    return hf_name


hf_name = name_table(_LAYER, _GLOBAL, "encoder.layer")


def encoder_config(
    gg: GGUFFile,
    token_types: bool = True,
    heads: tuple[str, ...] = _HEADS,
    rms_epsilon: bool = False,
) -> dict[str, Any]:
    """The HF-style fields every BERT-family GGUF gives alike, read as llama.cpp's
    load_hparams and the family's load_arch_hparams read them (context length, LayerNorm
    epsilon and, with `token_types`, a token type count required). Refuses causal attention
    (also where the file does not say, llama.cpp's default), KV heads other than the heads
    and a classifier head (tensors named `heads`), which llmrun's encoders do not have.
    With `rms_epsilon`, the LayerNorms' epsilon may be under layer_norm_rms_epsilon instead
    (where the converter writes ModernBERT's norm_eps)."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = meta.require(Keys.Attention.HEAD_COUNT)
    if meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads) != n_heads:
        raise UnsupportedError(
            f"{path}: a {arch} model with {meta.get(Keys.Attention.HEAD_COUNT_KV)} KV heads for "
            f"{n_heads} heads is not supported (BERT-family encoders have one per head)"
        )
    # llama.cpp attends causally unless the file says not (the converter always does).
    causal = meta.get(Keys.Attention.CAUSAL)
    if causal is not False:
        said = "is missing (llama.cpp then attends causally)" if causal is None else "is true"
        raise UnsupportedError(
            f"{path}: {Keys.Attention.CAUSAL.format(arch=arch)} {said}; llmrun runs {arch} "
            "models as encoders, every token attending to every other"
        )
    head = next((name for name in gg.tensors if name.rpartition(".")[0] in heads), None)
    if head is not None:
        raise UnsupportedError(
            f"{path}: tensor {head!r} is a classifier (reranker) head, which llmrun does not "
            "support; llmrun runs BERT-family models for embeddings"
        )
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get(TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight")
    config = {
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": n_heads,
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "layer_norm_eps": meta.get(Keys.Attention.LAYERNORM_EPS)
        or (meta.get(Keys.Attention.LAYERNORM_RMS_EPS) if rms_epsilon else None)
        or meta.require(Keys.Attention.LAYERNORM_EPS),
        "vocab_size": embed.shape[0] if embed else (len(tokens) if tokens else None),
    }
    if token_types:
        types = gg.metadata.get(Keys.Tokenizer.TOKEN_TYPE_COUNT)
        if not types:
            raise ModelFormatError(
                f"{path}: metadata {Keys.Tokenizer.TOKEN_TYPE_COUNT!r} is missing or 0 "
                f"(llama.cpp requires it of {arch} models)"
            )
        config["type_vocab_size"] = types
    return config


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style bert config from a "bert" GGUF (its position table starts at position
    0, whatever the model was), with a cross-encoder's classifier where the file has
    one (reranker.gguf_head)."""
    config = {"model_type": MODEL_TYPE, **encoder_config(gg, heads=()), "hidden_act": "gelu"}
    head = reranker.gguf_head(gg)
    if head is not None:
        config["classifier_labels"], config["classifier_dense"] = head
    return config


def gguf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight_type: type, qkv: str, parts: tuple
) -> dict:
    """The weights as the model takes them: a fused attn_qkv (named `qkv`; rows of
    queries, keys, values, weight and bias) as the `parts` projections, each a view of the
    file's rows (whole blocks where quantized); a token-type table the file leaves out
    (llama.cpp then adds nothing) as one row of zeros, a classifier's bias as zeros."""
    import torch

    hidden = config["hidden_size"]
    out = {}
    for name, w in weights.items():
        if f".{qkv}." not in name:
            out[name] = w
            continue
        if w.shape[0] != 3 * hidden:
            raise ModelFormatError(
                f"attn_qkv of layer {name.split('.')[2]} has {w.shape[0]} rows, but the "
                f"metadata implies {3 * hidden} (queries, keys and values of {hidden})"
            )
        for i, part in enumerate(parts):
            piece = w.tensor[i * hidden : (i + 1) * hidden]
            out[name.replace(qkv, part)] = weight_type(piece, w.ggml_type, (hidden, *w.shape[1:]))
    types = _GLOBAL[MODEL_TENSOR.TOKEN_TYPES] + ".weight"
    if types not in out:
        config["type_vocab_size"] = 1
        out[types] = weight_type(torch.zeros(1, hidden))
    for head in (_GLOBAL[MODEL_TENSOR.CLS], _GLOBAL[MODEL_TENSOR.CLS_OUT]):
        # A classifier's biases are optional (llama.cpp then adds nothing).
        weight = out.get(f"{head}.weight")
        if weight is not None and f"{head}.bias" not in out:
            out[f"{head}.bias"] = weight_type(torch.zeros(weight.shape[0]))
    return out


def hf_context(config: dict[str, Any], context: int | None) -> int | None:
    """The positions an encoder folder's model runs of the `context` its config.json
    states: RoBERTa's less the padding_idx + 1 rows it never reads (hf_checkpoint), the
    trained ones where a config names them (nomic's Hub files: max_trained_positions)."""
    pad = config.get("pad_token_id")
    if context and config.get("model_type") in OFFSET_POSITION_TYPES and pad is not None:
        return context - pad - 1
    return config.get("max_trained_positions") or context


def hf_checkpoint(
    config: dict[str, Any],
    weights: dict[str, Any],
    weight_type: type,
    path: str | Path = "config.json",
) -> tuple[dict[str, Any], dict]:
    """A Hub checkpoint as the model takes it (hf_weights), RoBERTa's position table cut
    by padding_idx + 1 rows and its max_position_embeddings by as many, as llama.cpp's
    converter cuts them: position 0 is the table's first row. A cross-encoder's
    classifier (reranker.hf_labels; `path` names the folder in errors) under the model's
    names: BERT's pooler.dense as classifier.dense, its classifier as classifier.out_proj."""
    labels = reranker.hf_labels(config, path)
    if labels:
        weights = _classifier_names(weights)
        config = {**config, "classifier_labels": labels, "classifier_dense": True}
    weights = hf_weights(weights)
    pad = config.get("pad_token_id")
    if config.get("model_type") in OFFSET_POSITION_TYPES and pad is not None:
        table = weights.get(_POSITIONS)
        if table is not None:
            cut = table.tensor[pad + 1 :]
            weights[_POSITIONS] = weight_type(cut)
            config = {**config, "max_position_embeddings": cut.shape[0]}
    return config, weights


def _classifier_names(weights: dict[str, Any]) -> dict:
    """A BertForSequenceClassification's pooler and classifier under the classification
    head's names (RoBERTa's are those already)."""
    out = {}
    for name, w in weights.items():
        bare = name.removeprefix("bert.")
        if bare.startswith("pooler.dense."):
            name = "classifier.dense." + bare.removeprefix("pooler.dense.")
        elif name in ("classifier.weight", "classifier.bias"):
            name = "classifier.out_proj." + name.removeprefix("classifier.")
        out[name] = w
    return out


def hf_weights(weights: dict[str, Any]) -> dict:
    """A Hub checkpoint's tensors under BertModel's names: without a "bert." or "roberta."
    prefix (BertForMaskedLM's, rerankers'), old LayerNorm gamma/beta as weight/bias, and
    without the pooler, the MLM/NSP heads and buffers, as llama.cpp's converter takes them."""
    out = {}
    for name, w in weights.items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith(_DROPPED_PREFIXES) or name in _DROPPED:
            continue
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        elif name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        out[name] = w
    return out
