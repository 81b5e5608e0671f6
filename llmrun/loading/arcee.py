"""Arcee AFM GGUFs (arch "arcee") as llama.cpp's converter writes them
(conversion/llama.py ArceeModel: LlamaModel's keys and its q/k row permutation, which
llama.cpp's "normal" RoPE expects; YaRN keys where the config has YaRN), read as
src/models/arcee.cpp reads them: whole heads rotated, Llama's GGUF names with no
ffn_gate.
"""

from __future__ import annotations

from typing import Any

from llmrun.loading import exaone
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "arcee"


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Arcee's checks of the HF-style config that config_from_gguf built: whole-head RoPE
    and YaRN as llama.cpp applies it (exaone.check_rope)."""
    exaone.check_rope(gg, config, meta, "Arcee")
