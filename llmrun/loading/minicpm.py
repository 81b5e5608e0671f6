"""MiniCPM GGUFs (arch "minicpm") as llama.cpp's converter writes them
(conversion/minicpm.py MiniCPMModel) and src/models/minicpm.cpp reads them (with
granite.cpp's graph), as MiniCPM's config.json fields (llmrun/models/minicpm.py).

The converter permutes the q/k rows as Llama's (the loader undoes it), writes the muP
scalars under the general keys (embedding_scale = scale_emb, residual_scale =
scale_depth / sqrt(layers), logit_scale = hidden_size / dim_model_base, which the graph
divides the logits by), and MiniCPM4's LongRoPE as rope.scaling.type "longrope" with the
factors in rope_factors_long/short (gguf_config's RoPE reader), but no original context:
llama.cpp then takes the context length for it, and the short factors unscaled within
it (a config.json whose context exceeds its original one has the long factors, scaled,
which its GGUF loses). Older files have no scalars: llama.cpp then takes those of every
released MiniCPM, scale_emb 12, scale_depth 1.4 and dim_model_base 256 (its default
logit_scale, 256 / n_embd, is the inverse of the hidden_size / 256 that those models
and its own older graph divide by; llmrun divides by the models'). llama.cpp reads no
attention scale for it (head_dim^-0.5).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = MODEL_TYPE = "minicpm"
# llama_model_minicpm::load_arch_hparams's values where a key is absent.
SCALE_EMB, SCALE_DEPTH, DIM_MODEL_BASE = 12.0, 1.4, 256


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """MiniCPM's fields of the HF-style config that config_from_gguf built: its three
    scalars from the general keys (absent: the released models', as llama.cpp takes
    them). Refuses experts (MiniCPM-MoE) and RoPE on part of a head, which llama.cpp's
    graph asserts away."""

    if meta.get(Keys.LLM.EXPERT_COUNT):
        raise UnsupportedError(
            f"{gg.path}: a minicpm file with experts (MiniCPM-MoE) is not supported"
        )
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{config['head_dim']}; llama.cpp's minicpm rotates whole heads"
        )
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    embedding, residual, logits = (
        meta.get(Keys.LLM.EMBEDDING_SCALE),
        meta.get(Keys.LLM.RESIDUAL_SCALE),
        meta.get(Keys.LLM.LOGIT_SCALE),
    )
    if logits == 0:
        raise ModelFormatError(f"{gg.path}: {meta.name(Keys.LLM.LOGIT_SCALE)} is 0")
    config.update(
        scale_emb=SCALE_EMB if embedding is None else embedding,
        scale_depth=SCALE_DEPTH if residual is None else residual * math.sqrt(layers),
        dim_model_base=DIM_MODEL_BASE if logits is None else hidden / logits,
    )
