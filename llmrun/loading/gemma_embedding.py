"""EmbeddingGemma at the loader edge (llmrun/models/gemma_embedding.py): HF folders (a
`gemma3_text` config with use_bidirectional_attention, Gemma3TextModel's headless weights,
sentence-transformers' 2_Dense and 3_Dense) and "gemma-embedding" GGUFs as llama.cpp's
converter writes them (conversion/gemma.py EmbeddingGemma) and src/models/gemma-embedding.cpp
reads them.

The converter writes Gemma 3's keys and tensors (norm weights as 1 + w; no output matrix),
sliding_window as config.json gives it, pooling_type, and with
--sentence-transformers-dense-modules the Dense weights as dense_2.weight and dense_3.weight
(no bias) with `{arch}.dense_2_feat_in` and its kin. llama.cpp reads: the RMS epsilon and
sliding_window (required), rope.freq_base_swa (10000 where absent), every sixth layer global
(load_swa_pattern(ml, 6)), a sliding query seeing keys within sliding_window / 2 either way,
queries scaled by head_dim^-0.5 whatever the size, attention never causal; then after the
pooling dense_2, then dense_3, where the file has them.

No torch here: `llmrun show` reads this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gguf import Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "gemma-embedding"
MODEL_TYPE = "gemma_embedding"  # llmrun/models/gemma_embedding.py
# The GGUF's Dense weights, in the order llama.cpp applies them.
DENSE_TENSORS = ("dense_2.weight", "dense_3.weight")


def hf_applies(config: dict[str, Any]) -> bool:
    """Whether an HF config.json is EmbeddingGemma's: Gemma 3's text model, bidirectional."""
    return config.get("model_type") == "gemma3_text" and bool(
        config.get("use_bidirectional_attention")
    )


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], dense: list[dict[str, Any]], weight: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An EmbeddingGemma folder's config under llmrun's model type, with its Dense modules
    (embedding.hf_dense) as the model's projections and their weights under
    `projections.N.` (wrapped in `weight`, the loader's Weight)."""
    from llmrun.loading.safetensors_io import load_tensors

    projections, weights = [], dict(weights)
    for i, module in enumerate(dense):
        stored = load_tensors(module["file"])
        names = {"linear.weight", "linear.bias"} if module["bias"] else {"linear.weight"}
        if set(stored) != names:
            raise ModelFormatError(
                f"{module['file']}: expected the tensors {', '.join(sorted(names))}, found "
                f"{', '.join(sorted(stored)) or 'none'}"
            )
        for name, tensor in stored.items():
            weights[f"projections.{i}.{name.removeprefix('linear.')}"] = weight(tensor)
        projections.append({k: module[k] for k in ("in_features", "out_features", "bias")})
    return {**config, "model_type": MODEL_TYPE, "projections": projections}, weights


def hf_name(gguf_name: str) -> str | None:
    """The model's name for a Dense tensor of the GGUF; None for others."""
    if gguf_name in DENSE_TENSORS:
        return f"projections.{DENSE_TENSORS.index(gguf_name)}.weight"
    return None


def finish_config(
    gg: GGUFFile,
    config: dict[str, Any],
    gemma_config: Callable[..., dict[str, Any]],
    meta: ArchMetadata,
) -> dict[str, Any]:
    """EmbeddingGemma's config from a "gemma-embedding" GGUF: Gemma 3's (gemma_config,
    gguf_config._gemma_config, given config's common fields and the file's metadata), with llama.cpp's query scale and the Dense projections the file holds."""
    path = gg.path
    if meta.get(Keys.Attention.SLIDING_WINDOW) is None:
        raise ModelFormatError(f"{path}: metadata {ARCH}.attention.sliding_window is missing")
    config = gemma_config(gg, {**config, "model_type": "gemma3_text"}, meta)
    config["model_type"] = MODEL_TYPE
    config["query_pre_attn_scalar"] = config["head_dim"]
    config["projections"] = _projections(gg, config["hidden_size"])
    return config


def _projections(gg: GGUFFile, hidden: int) -> list[dict[str, Any]]:
    """The Dense projections of the file, from their tensors' shapes, checked as llama.cpp
    checks them (dense_2 takes the hidden states, dense_3 gives vectors of that width)."""
    present = [name for name in DENSE_TENSORS if name in gg.tensors]
    if present == DENSE_TENSORS[1:]:
        raise ModelFormatError(f"{gg.path}: dense_3.weight without dense_2.weight")
    out = []
    for name in present:
        features_out, features_in = (int(d) for d in gg.tensors[name].shape)  # torch order
        out.append({"in_features": features_in, "out_features": features_out, "bias": False})
    if out and (out[0]["in_features"] != hidden or out[-1]["out_features"] != hidden):
        raise ModelFormatError(
            f"{gg.path}: the Dense projections must take and give {hidden} features "
            f"({Keys.LLM.EMBEDDING_LENGTH.format(arch=ARCH)}), as llama.cpp requires"
        )
    if len(out) == 2 and out[0]["out_features"] != out[1]["in_features"]:
        raise ModelFormatError(f"{gg.path}: dense_2's outputs are not dense_3's inputs")
    return out
