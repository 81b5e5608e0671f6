"""What a checkpoint says about reranking: whether it is a cross-encoder (a sequence
classifier with one label, its logit the relevance score) and the shape of its head, read
from an HF folder's config.json (`*ForSequenceClassification`, its labels) or a GGUF's
classifier tensors (`cls`, `cls.output`) and `<arch>.pooling_type` (rank), as llama.cpp's
converter writes them; or a causal reranker's GGUF (Qwen3-Reranker: CAUSAL_ARCHS).

No torch here: `llmrun show` reads these too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys, PoolingType

from llmrun.errors import ModelFormatError, UnsupportedError

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

_CLASSIFIER = "ForSequenceClassification"
_DENSE = TENSOR_NAMES[MODEL_TENSOR.CLS] + ".weight"
_OUT = TENSOR_NAMES[MODEL_TENSOR.CLS_OUT] + ".weight"
CLS_OUT = _OUT
# Causal LMs llama.cpp's converter turns into rerankers (conversion/qwen.py,
# Qwen3-Reranker): cls.output holds the output head's "yes" and "no" rows, and the
# score is softmax over them, "yes"'s share, at the prompt's last token.
CAUSAL_ARCHS = ("qwen3",)
# The pooling before the head (ModernBERT's mean); gguf-py 0.18 has no constant for it.
_CLASSIFIER_POOLING = "{arch}.classifier.pooling_type"


def hf_labels(config: dict[str, Any], path: Path | str) -> int:
    """The labels of a config.json's sequence classifier (1: a reranker), 0 where its
    `architectures` name none; a classifier of several labels is refused."""
    classes = config.get("architectures") or []
    if not any(str(c).endswith(_CLASSIFIER) for c in classes):
        return 0
    id2label = config.get("id2label")
    labels = len(id2label) if isinstance(id2label, dict) else config.get("num_labels", 2)
    if labels != 1:
        raise UnsupportedError(
            f"{path}: a sequence classifier of {labels} labels is not a reranker; llmrun runs "
            "cross-encoders of one label (its logit is the relevance score)"
        )
    return 1


def gguf_head(gg: GGUFFile) -> tuple[int, bool] | None:
    """A GGUF cross-encoder's head as (labels, whether a dense + tanh `cls` comes before
    the `cls.output` projection); None for a file without classifier tensors. A file whose
    pooling_type is rank without them, a head without cls.output or of several labels, and
    a pooling before the head other than the first token's are refused."""
    arch, path = gg.architecture, gg.path
    pooling_key = Keys.LLM.POOLING_TYPE.format(arch=arch)
    dense, out = gg.tensors.get(_DENSE), gg.tensors.get(_OUT)
    if dense is None and out is None:
        if gg.metadata.get(pooling_key) == PoolingType.RANK:
            raise ModelFormatError(
                f"{path}: {pooling_key} is rank (a reranker), but the file has no classifier "
                f"tensors ({_DENSE}, {_OUT})"
            )
        return None
    if out is None:
        raise UnsupportedError(
            f"{path}: a classifier {_DENSE} without {_OUT} is not supported (llmrun runs "
            "cross-encoders whose head ends in an output projection)"
        )
    labels = out.shape[0]
    if labels != 1:
        raise UnsupportedError(
            f"{path}: {_OUT} has {labels} rows: a classifier of {labels} labels is not a "
            "reranker; llmrun runs cross-encoders of one label"
        )
    pooling = gg.metadata.get(_CLASSIFIER_POOLING.format(arch=arch))
    if pooling is not None and pooling != PoolingType.CLS:
        raise UnsupportedError(
            f"{path}: {_CLASSIFIER_POOLING.format(arch=arch)} is {pooling}; llmrun's {arch} "
            "classifier reads the first token's state (cls, 2)"
        )
    return labels, dense is not None


def causal_head(gg: GGUFFile) -> None:
    """Checks a causal reranker's file (CAUSAL_ARCHS, pooling_type rank): cls.output of
    two rows ("yes" and "no") and a rerank prompt template."""
    out = gg.tensors.get(_OUT)
    if out is None or out.shape[0] != 2:
        rows = "missing" if out is None else f"of {out.shape[0]} rows"
        raise ModelFormatError(
            f"{gg.path}: a {gg.architecture} reranker's {_OUT} is {rows}; llama.cpp's "
            "converter writes the output head's yes and no rows there"
        )
    if gg.metadata.get(RERANK_TEMPLATE) is None:
        raise ModelFormatError(
            f"{gg.path}: a {gg.architecture} reranker without a {RERANK_TEMPLATE} prompt"
        )


# The prompt of a causal reranker: {query} and {document} replaced (llama.cpp's server).
RERANK_TEMPLATE = Keys.Tokenizer.CHAT_TEMPLATE_N.format(name="rerank")


def is_reranker(config: dict[str, Any]) -> bool:
    """Whether a loader's config (bert.config_from_gguf, bert.hf_checkpoint) is a
    cross-encoder's."""
    return bool(config.get("classifier_labels"))


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a config.json: whether it is a reranker (a sequence
    classifier of one label)."""
    try:
        return {"reranker": hf_labels(config, "config.json") == 1}
    except UnsupportedError:
        return {"reranker": False}
