"""EuroBERT at the loader edge: "eurobert" GGUFs as llama.cpp's converter writes them
(conversion/bert.py EuroBertModel, also registered for JinaEmbeddingsV5Model) and
src/models/eurobert.cpp reads them, and the Hub's checkpoints (EuroBertModel's names, or
EuroBertForMaskedLM's "model." prefix and lm_head) under EuroBertModel's names
(llmrun/models/eurobert.py).

The converter writes TextModel's keys (head_count_kv, rope.freq_base, the RMS norms'
epsilon, key_length where the config has head_dim), attention.causal false, rope scaling
none, the pooling of a sentence-transformers folder's Pooling module where it has one, and
the tensors as they are (q/k rows not permuted: llama.cpp rotates them as NEOX, the halves
of each head), the "model." prefix stripped; --fuse-qkv joins each layer's q, k and v rows
into one attn_qkv. It refuses a config whose classifier_pooling is "late" (EuroBertConfig's
default, which transformers 5 fills in where config.json has none): it takes cls or mean.
llama.cpp reads: the RMS epsilon (required), SiLU's gated feed-forward, no biases but
q/k/v's optional ones, and no pooling where the file names none.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import bert
from llmrun.loading.gguf_io import ArchMetadata, vocab_size

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = MODEL_TYPE = "eurobert"
_FUSED_QKV = "self_attn.qkv_proj"
hf_name = bert.name_table(
    {
        MODEL_TENSOR.ATTN_NORM: "input_layernorm",
        MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
        MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
        MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
        MODEL_TENSOR.ATTN_QKV: _FUSED_QKV,
        MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
        MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
        MODEL_TENSOR.FFN_GATE: "mlp.gate_proj",
        MODEL_TENSOR.FFN_UP: "mlp.up_proj",
        MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
    },
    {MODEL_TENSOR.TOKEN_EMBD: "embed_tokens", MODEL_TENSOR.OUTPUT_NORM: "norm"},
    "layers",
)
# The Hub's heads, which an encoder's output leaves out (EuroBertForMaskedLM's), or which
# llmrun does not run (EuroBertForSequenceClassification's and ForTokenClassification's).
_DROPPED_PREFIXES = ("lm_head.",)
_CLASSIFIER_PREFIXES = ("dense.", "classifier.")
# jina-embeddings-v5's folders: a base model (-nano's EuroBERT, -small's Qwen3) and a LoRA
# adapter per task under adapters/<task>/, which its modeling code adds at load.
JINA_V5_ARCHITECTURE = "JinaEmbeddingsV5Model"
_JINA_V5_ADAPTERS = "adapters"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """An HF-style eurobert config from a "eurobert" GGUF, as llama.cpp reads it (RoPE by
    `rope_from_gguf`, gguf_config's reader). Refuses causal attention (also where the file
    does not say: llama.cpp's default) and biases, which EuroBERT has none of."""
    path = gg.path
    meta = ArchMetadata.of(gg)
    causal = meta.get(Keys.Attention.CAUSAL)
    if causal is not False:
        said = "is missing (llama.cpp then attends causally)" if causal is None else "is true"
        raise UnsupportedError(
            f"{path}: {Keys.Attention.CAUSAL.format(arch=ARCH)} {said}; llmrun runs {ARCH} "
            "models as encoders, every token attending to every other"
        )
    bias = next((name for name in gg.tensors if name.endswith(".bias")), None)
    if bias is not None:
        raise UnsupportedError(f"{path}: tensor {bias!r} is a bias, which {ARCH} models lack")
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = meta.require(Keys.Attention.HEAD_COUNT)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "rope_parameters": rope_from_gguf(gg, meta, head_dim, context),
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The weights as the model takes them: each fused attn_qkv (rows of all queries, then
    keys, then values) as q_proj, k_proj and v_proj, views of the file's rows (whole rows
    of a quantized tensor's blocks). `weight_type` wraps a tensor (loader.Weight)."""
    head_dim = config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    out = {}
    for name, w in weights.items():
        if f".{_FUSED_QKV}." not in name:
            out[name] = w
            continue
        if w.shape[0] != q_rows + 2 * kv_rows:
            raise ModelFormatError(
                f"attn_qkv of layer {name.split('.')[1]} has {w.shape[0]} rows, but the heads "
                f"make {q_rows} query rows and {kv_rows} key and value rows each"
            )
        start = 0
        for part, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            piece = w.tensor.narrow(0, start, rows)
            out[name.replace(_FUSED_QKV, f"self_attn.{part}")] = weight_type(
                piece, w.ggml_type, (rows, *w.shape[1:])
            )
            start += rows
    return out


def hf_weights(weights: dict[str, Any]) -> dict:
    """A Hub checkpoint's tensors under EuroBertModel's names: without the "model." prefix
    and the MLM head; a classifier's (a fine-tuned classifier's or reranker's) is refused."""
    out = {}
    for name, w in weights.items():
        if name.startswith(_CLASSIFIER_PREFIXES):
            raise UnsupportedError(
                f"tensor {name!r} is a classifier head (EuroBertForSequenceClassification or "
                "ForTokenClassification), which llmrun does not support; it runs EuroBERT "
                "for embeddings"
            )
        if name.startswith(_DROPPED_PREFIXES):
            continue
        out[name.removeprefix("model.")] = w
    return out


def refuse_task_adapters(config: dict[str, Any], path: Path) -> None:
    """Refuse a jina-embeddings-v5 folder with its task adapters: its base weights alone
    are not the model, and llmrun does not merge an adapter into them."""
    if (
        JINA_V5_ARCHITECTURE in (config.get("architectures") or [])
        and (path / _JINA_V5_ADAPTERS).is_dir()
    ):
        raise UnsupportedError(
            f"{path}: a jina-embeddings-v5 folder ({JINA_V5_ARCHITECTURE}) is a base model "
            f"and a LoRA adapter per task ({_JINA_V5_ADAPTERS}/), which llmrun does not "
            "merge; run one task's merged model (Jina's jina-embeddings-v5-text-nano-retrieval "
            "and the like, or their GGUFs)"
        )
