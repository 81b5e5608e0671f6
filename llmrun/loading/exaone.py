"""EXAONE 3.x checkpoints and GGUFs. Hugging Face folders keep GPT-2's module names
(transformer.wte, transformer.h.N.attn.attention.q_proj, ln_1, mlp.c_fc_0, ...), which
transformers renames to Llama's on loading (conversion_mapping.py, "exaone") and so does
hf_checkpoint. llama.cpp's converter (conversion/exaone.py ExaoneModel: TextModel's
keys, the rope dimension count, Llama 3 scaling as a rope_freqs tensor) writes the
"exaone" arch with Llama's GGUF names and the q/k rows as they are, since llama.cpp turns
EXAONE with NEOX RoPE; src/models/exaone.cpp rotates whole heads.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "exaone"
# The checkpoints' module names -> Llama's, in transformers' order.
_RENAMES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^transformer\.wte\.", "model.embed_tokens."),
        (r"^transformer\.h\.", "model.layers."),
        (r"^transformer\.ln_f\.", "model.norm."),
        (r"\.attn\.attention\.", ".self_attn."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.ln_1\.", ".input_layernorm."),
        (r"\.ln_2\.", ".post_attention_layernorm."),
        (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
        (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    )
)


def llama_name(name: str) -> str:
    """The Llama key of an EXAONE checkpoint key (a Llama key stays as it is)."""
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An EXAONE folder's config with Llama's field names (num_layers ->
    num_hidden_layers, ...) and its weights under Llama's keys."""
    from llmrun.models.exaone import canonical_config  # here: list and show stay torch-free

    renamed: dict[str, Any] = {}
    for name, weight in weights.items():
        new = llama_name(name)
        if new in renamed:
            raise ModelFormatError(f"{path}: {name} and another tensor are both EXAONE's {new}")
        renamed[new] = weight
    return canonical_config(config), renamed


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """EXAONE's checks of the HF-style config that config_from_gguf built (whole-head
    RoPE, YaRN as llama.cpp applies it: check_rope)."""
    check_rope(gg, config, meta, "EXAONE")


def check_rope(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata, family: str) -> None:
    """Refuses, for a family whose llama.cpp graph rotates whole heads (EXAONE, Arcee),
    a rope dimension count below the head size, and YaRN settings llama.cpp would not
    apply as transformers does: an extrapolation factor other than 1, and a magnitude
    (yarn_attn_factor) other than the 0.1 ln(factor) + 1 llama.cpp takes whatever the
    key says (llama_context's constructor); and a rope.scaling.attn_factor other than 1."""
    arch = gg.architecture
    rope = config["rope_parameters"]
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=arch)} is not the head size "
            f"{config['head_dim']}; {family} rotates whole heads"
        )
    if rope["rope_type"] == "yarn":
        ext = meta.get(Keys.Rope.SCALING_YARN_EXT_FACTOR)
        if ext is not None and ext != 1.0:
            raise UnsupportedError(
                f"{gg.path}: a YaRN extrapolation factor of {ext} is not supported (1.0 is)"
            )
        factor = rope.get("factor") or 1.0
        usual = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
        magnitude = meta.get(Keys.Rope.SCALING_YARN_ATTN_FACTOR)
        if magnitude is not None and abs(magnitude - usual) > 1e-6:
            raise UnsupportedError(
                f"{gg.path}: {Keys.Rope.SCALING_YARN_ATTN_FACTOR.format(arch=arch)} is "
                f"{magnitude}, which llama.cpp does not apply ({usual:.6g} instead); llmrun "
                "does not guess which the model needs"
            )
    scale = meta.get(Keys.Rope.SCALING_ATTN_FACTOR, 1.0)
    if scale != 1.0:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.SCALING_ATTN_FACTOR.format(arch=arch)} other than 1 is "
            "not supported"
        )
