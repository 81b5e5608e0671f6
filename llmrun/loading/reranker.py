"""What a checkpoint says about reranking: whether it is a cross-encoder (a sequence
classifier with one label, its logit the relevance score) and the shape of its head, read
from an HF folder's config.json (`*ForSequenceClassification`, its labels) or a GGUF's
classifier tensors (`cls`, `cls.output`) and `<arch>.pooling_type` (rank), as llama.cpp's
converter writes them; or a causal reranker (Qwen3-Reranker: CAUSAL_ARCHS), a GGUF or an
HF folder that llama.cpp's converter would write as one (hf_causal_reranker).

No torch here: `llmrun show` reads these too.
"""

from __future__ import annotations

import json
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
# Qwen3-Reranker; conversion/qwen3vl.py's Qwen3VLTextModel, a Qwen3Model, takes
# Qwen3-VL-Reranker's language model alike): cls.output holds the output head's "yes" and
# "no" rows, and the score is softmax over them, "yes"'s share, at the prompt's last token.
CAUSAL_ARCHS = ("qwen3", "qwen3vl")
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
# What llama.cpp's converter writes there for a Qwen3-Reranker folder (conversion/qwen.py):
# the model card's prompt with its default instruction.
QWEN3_RERANK_PROMPT = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
# The tokens whose output-head rows make a causal reranker's head, in its order.
CAUSAL_LABELS = ("yes", "no")
_CAUSAL_HF_TYPES = ("qwen3", "qwen3_vl")
_CAUSAL_HF_NAMES = ("qwen3-reranker", "qwen3-vl-reranker")


def hf_causal_reranker(config: dict[str, Any], folder: Path) -> bool:
    """Whether an HF folder is a Qwen3-Reranker (a causal LM scored by its "yes" and "no"
    logits), as llama.cpp's converter decides (conversion/qwen.py): a qwen3 model (or
    Qwen3-VL's, or its language model's config) whose README.md has a `# Qwen3-Reranker` or
    `# Qwen3-VL-Reranker` heading, or whose folder name, `_name_or_path` or architecture
    names one. A Qwen3ForSequenceClassification is refused: its head is not the output
    head's rows."""
    if config.get("model_type") not in _CAUSAL_HF_TYPES:
        return False
    architecture = str((config.get("architectures") or [""])[0])
    if architecture.endswith(_CLASSIFIER):
        raise UnsupportedError(
            f"{folder}: {architecture} is not supported; llmrun reranks with the "
            "Qwen3-Reranker checkpoints (Qwen3ForCausalLM) and their GGUFs"
        )
    hints = (folder.name, config.get("_name_or_path"), config.get("model_type"), architecture)
    if any(name in str(hint or "").lower() for hint in hints for name in _CAUSAL_HF_NAMES):
        return True
    try:
        readme = (folder / "README.md").read_text(encoding="utf-8", errors="replace").lower()
    except OSError:
        return False
    return any(f"# {name}" in readme for name in _CAUSAL_HF_NAMES)


def causal_hint(config: dict[str, Any]) -> str:
    """For a folder of a causal reranker's family: how it is recognized as one."""
    if config.get("model_type") not in _CAUSAL_HF_TYPES:
        return ""
    return (
        ", or a Qwen3-Reranker folder: one whose README.md has a '# Qwen3-Reranker' heading "
        "or whose name says Qwen3-Reranker, as llama.cpp's converter recognizes it"
    )


def hf_label_ids(folder: Path) -> list[int]:
    """The ids of CAUSAL_LABELS in a folder's tokenizer.json, looked up as transformers'
    convert_tokens_to_ids does (added tokens, then the model's vocabulary), as llama.cpp's
    converter picks the head's rows."""
    file = folder / "tokenizer.json"
    try:
        tokenizer = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(
            f"{folder}: a causal reranker without a tokenizer.json, whose yes and no tokens "
            "pick its head's rows"
        ) from None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: cannot be read as JSON: {e}") from None
    vocab = (tokenizer.get("model") or {}).get("vocab")
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict):
            ids[token.get("content")] = token.get("id")
    found = []
    for label in CAUSAL_LABELS:
        i = ids.get(label)
        if not isinstance(i, int) or i < 0:
            raise ModelFormatError(
                f"{file}: no token {label!r}, whose output-head row scores a causal reranker"
            )
        found.append(i)
    return found


def is_reranker(config: dict[str, Any]) -> bool:
    """Whether a loader's config (bert.config_from_gguf, bert.hf_checkpoint) is a
    cross-encoder's."""
    return bool(config.get("classifier_labels"))


def hf_info(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """What `llmrun show` says of a folder's config.json: whether it is a reranker (a
    sequence classifier of one label, or a causal reranker)."""
    try:
        labels = hf_labels(config, "config.json")
        return {"reranker": labels == 1 or hf_causal_reranker(config, folder)}
    except UnsupportedError:
        return {"reranker": False}
