"""GIT folders (GitForCausalLM: microsoft/git-*) at the loader edge: the text decoder's
config (GitConfig's text fields, with how many tokens an image takes: its CLIP tower's
patches and class token) and its tensors under llmrun.models.git's names; the image
encoder's (git.image_encoder.*, git.visual_projection.*) are the vision family's
(llmrun.loading.git_vision). No llama.cpp converter writes GIT: folders only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError

MODEL_TYPE = "git"
_IMAGE_ENCODER = ("git.image_encoder.", "git.visual_projection.", "git.img_temporal_embedding")
_NAMES = {
    "git.embeddings.word_embeddings.": "model.embed_tokens.",
    "git.embeddings.position_embeddings.": "model.embed_positions.",
    "git.embeddings.LayerNorm.": "model.embed_norm.",
    "git.encoder.layer.": "model.layers.",
    "output.": "lm_head.",
}
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def image_tokens(vision: dict[str, Any], source: Path) -> int:
    """How many tokens GIT's CLIP tower gives an image: a patch's each and its class
    token's (GitVisionConfig's defaults where the file leaves them out)."""
    size, patch = vision.get("image_size", 224), vision.get("patch_size", 16)
    sizes = (size, patch)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes) or (
        size % patch
    ):
        raise ModelFormatError(
            f"{source}: GIT's vision image_size {size!r} is not a multiple of patch_size {patch!r}"
        )
    return (size // patch) ** 2 + 1


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text decoder's config and tensors of a GIT folder."""
    vision = config.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise ModelFormatError(f"{path}: GIT's vision_config is not an object")
    text = {k: v for k, v in config.items() if k != "vision_config"}
    text["image_tokens"] = image_tokens(vision, path / "config.json")
    out = {}
    for name, weight in weights.items():
        if name.startswith(_IMAGE_ENCODER):
            continue
        for old, new in _NAMES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = weight
    if HEAD not in out and config.get("tie_word_embeddings", False) and EMBEDDING in out:
        out[HEAD] = out[EMBEDDING]
    return text, out
