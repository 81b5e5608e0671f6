"""Nanbeige 4.2 GGUFs (arch "nanbeige") as llama.cpp's converter writes them
(conversion/nanbeige.py NanbeigeModel: LlamaModel's keys and q/k rows permuted as a
llama's, which the loader undoes, plus num_loops and skip_loop_final_norm), read as
llama_model_nanbeige::load_arch_hparams reads them: one loop and the norm between loops
where the file leaves the keys out. llama.cpp scales the attention by attention.scale where
a file gives one; llmrun refuses such a file rather than guess what the checkpoint meant.
"""

from __future__ import annotations

import math
from typing import Any

from gguf import Keys

from llmrun.errors import UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "nanbeige"
# Keys newer than the gguf package llmrun depends on (gguf-py's Keys.LLM names them).
NUM_LOOPS = "{arch}.num_loops"
SKIP_LOOP_FINAL_NORM = "{arch}.skip_loop_final_norm"


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Nanbeige's fields of the config config_from_gguf built: num_loops and
    skip_loop_final_norm."""
    config["num_loops"] = meta.get(NUM_LOOPS, 1)
    config["skip_loop_final_norm"] = bool(meta.get(SKIP_LOOP_FINAL_NORM, False))
    scale = meta.get(Keys.Attention.SCALE, 0.0)
    if scale and not math.isclose(scale, config["head_dim"] ** -0.5, rel_tol=1e-6):
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.Attention.SCALE)} is {scale}, not 1/sqrt(head size); "
            "llmrun supports Nanbeige's usual attention scale only"
        )
