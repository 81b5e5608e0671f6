"""What a checkpoint says about its embeddings: the pooling, and whether vectors are
normalized, read from a GGUF's `<arch>.pooling_type` or an HF folder's sentence-transformers
modules; and the weights of a base model saved for embeddings (Qwen3-Embedding's
`Qwen3Model`: no `model.` prefix, no output head) under its causal LM's names.

No torch here: `llmrun show` reads these too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import Keys, PoolingType

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import bert, gemma_embedding, reranker

POOLINGS = ("mean", "cls", "last")
# llama.cpp's pooling enum (LLAMA_POOLING_TYPE_*), as `<arch>.pooling_type` stores it.
GGUF_POOLINGS = {
    PoolingType.NONE: "none",
    PoolingType.MEAN: "mean",
    PoolingType.CLS: "cls",
    PoolingType.LAST: "last",
    PoolingType.RANK: "rank",  # a reranker's: its classifier reads the pooled state
}
# sentence-transformers' Pooling config: the flag of each pooling llmrun computes, and those
# it does not (refused by name rather than pooled otherwise).
_ST_POOLINGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST_MODULES = "sentence_transformers.models."
# The modules llmrun applies: the model, the pooling, the normalization, and for models
# that hold them (EmbeddingGemma's 2_Dense, 3_Dense), Dense projections after the pooling.
_ST_KNOWN = {"Transformer", "Pooling", "Normalize"}
_ST_DENSE = "Dense"
# A Dense module's activation_function that llmrun applies: none.
_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")


def gguf_pooling(metadata: dict[str, Any], arch: str, path: Path) -> str | None:
    """The pooling `<arch>.pooling_type` names ("none", "mean", "cls", "last", or "rank":
    a reranker's, of a BERT-family cross-encoder or a causal reranker's family alone), None
    where the file has none."""
    key = Keys.LLM.POOLING_TYPE.format(arch=arch)
    value = metadata.get(key)
    if value is None:
        return None
    if value == PoolingType.RANK and arch not in (bert.ARCH, *reranker.CAUSAL_ARCHS):
        raise UnsupportedError(
            f"{path}: {key} is {value} (rank): a {arch} reranker is not supported; llmrun "
            f"reranks with BERT-family cross-encoders ({bert.ARCH} files) and "
            f"{', '.join(reranker.CAUSAL_ARCHS)} rerankers"
        )
    try:
        return GGUF_POOLINGS[PoolingType(value)]
    except (ValueError, KeyError):
        raise ModelFormatError(
            f"{path}: {key} is {value!r}, which is not one of llama.cpp's pooling types (0 to 4)"
        ) from None


def gguf_causal(metadata: dict[str, Any], arch: str) -> bool:
    """Whether the file's attention is causal (`<arch>.attention.causal`, true unless set;
    never for EmbeddingGemma, whose llama.cpp loader turns it off whatever the file says)."""
    if arch == gemma_embedding.ARCH:
        return False
    return metadata.get(Keys.Attention.CAUSAL.format(arch=arch), True) is not False


def hf_pooling(folder: Path, dense: bool = False) -> tuple[str | None, bool | None]:
    """The pooling and normalization of a sentence-transformers folder (modules.json, its
    Pooling module's config.json, a Normalize module after it); (None, None) for a folder
    without modules.json. A module llmrun does not apply is refused by name: Dense unless
    `dense` (the model applies them, see hf_dense)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, None
    known = _ST_KNOWN | {_ST_DENSE} if dense else _ST_KNOWN
    pooling, normalized = None, False
    for module in _modules(modules_file):
        kind = str(module.get("type", ""))
        name = kind.removeprefix(_ST_MODULES)
        if name not in known:
            raise UnsupportedError(
                f"{modules_file}: module {module.get('path') or module.get('name')!r} is a "
                f"{kind}, which llmrun does not apply (it applies the model, its Pooling and "
                "Normalize)"
            )
        if name == "Pooling":
            pooling = _st_pooling(folder / str(module.get("path", "")) / "config.json")
        elif name == "Normalize":
            normalized = True
    return pooling, normalized


def hf_dense(folder: Path) -> list[dict[str, Any]]:
    """The Dense modules of a sentence-transformers folder, in order: each one's
    in_features, out_features, bias and weights file (`model.safetensors`, its
    `linear.weight` and `linear.bias`); one with an activation is refused."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return []
    out = []
    for module in _modules(modules_file):
        if str(module.get("type", "")).removeprefix(_ST_MODULES) != _ST_DENSE:
            continue
        where = folder / str(module.get("path", ""))
        config = _read_json(where / "config.json")
        if not isinstance(config, dict):
            raise ModelFormatError(f"{where / 'config.json'}: expected a JSON object")
        act = config.get("activation_function", _IDENTITY[0])
        if act not in _IDENTITY:
            raise UnsupportedError(
                f"{where / 'config.json'}: Dense activation_function {act!r} is not supported "
                "(llmrun applies Dense modules without an activation: torch.nn.Identity)"
            )
        weights = where / "model.safetensors"
        if not weights.is_file():
            raise ModelFormatError(f"{weights}: missing (the Dense module's weights)")
        try:
            features = {k: int(config[k]) for k in ("in_features", "out_features")}
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(
                f"{where / 'config.json'}: in_features and out_features must be integers"
            ) from None
        out.append({**features, "bias": bool(config.get("bias", True)), "file": weights})
    return out


def _modules(modules_file: Path) -> list[dict[str, Any]]:
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelFormatError(f"{modules_file}: expected a list of modules")
    return modules


def _st_pooling(config_file: Path) -> str:
    """The pooling a sentence-transformers Pooling config.json asks for."""
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ModelFormatError(f"{config_file}: expected a JSON object")
    unsupported = [flag for flag in _ST_UNSUPPORTED if config.get(flag)]
    chosen = [mode for flag, mode in _ST_POOLINGS.items() if config.get(flag)]
    if config.get("include_prompt") is False:
        unsupported.append("include_prompt false")
    if unsupported:
        raise UnsupportedError(
            f"{config_file}: {', '.join(unsupported)} is not supported (poolings: "
            f"{', '.join(POOLINGS)})"
        )
    if len(chosen) != 1:
        raise UnsupportedError(
            f"{config_file}: asks for {' + '.join(chosen) or 'no'} pooling; llmrun computes one "
            f"of {', '.join(POOLINGS)}"
        )
    return chosen[0]


def headless(weights: dict[str, Any]) -> bool:
    """Whether HF weights are a base model's alone (`embed_tokens.weight`, `layers.N...`,
    `norm.weight`: transformers' *Model saved on its own, as sentence-transformers does)."""
    return "embed_tokens.weight" in weights and not any(k.startswith("model.") for k in weights)


def causal_lm_names(weights: dict[str, Any]) -> dict[str, Any]:
    """A headless base model's weights under its causal LM's names (`model.` before each);
    without `lm_head.weight`, the loader ties the head to the embeddings."""
    return {f"model.{name}": weight for name, weight in weights.items()}


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{file}: missing (modules.json names it)") from None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: cannot be read as JSON: {e}") from None


# transformers' class names of models with an output head that generates.
_GENERATING_CLASSES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def gguf_info(metadata: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """What `llmrun show` says of a GGUF's embeddings: its pooling (llama.cpp's name, or
    the number where llmrun refuses it), and whether it is an embedding model (an encoder:
    non-causal attention)."""
    try:
        pooling = gguf_pooling(metadata, arch, path)
    except (UnsupportedError, ModelFormatError):
        pooling = str(metadata.get(Keys.LLM.POOLING_TYPE.format(arch=arch)))
    return {"pooling": pooling, "embedding_model": not gguf_causal(metadata, arch)}


def hf_info(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of an HF folder's embeddings: its sentence-transformers
    pooling (and normalization), and whether it is an embedding model (no class of its
    config.json's `architectures` generates)."""
    try:
        pooling, normalized = hf_pooling(folder, dense=gemma_embedding.hf_applies(config))
    except (UnsupportedError, ModelFormatError) as e:
        pooling, normalized = f"unsupported ({e})", None
    if pooling is not None and normalized:
        pooling += ", normalized"
    classes = config.get("architectures") or []
    generating = any(str(c).endswith(_GENERATING_CLASSES) for c in classes)
    return {"pooling": pooling, "embedding_model": bool(classes) and not generating}
