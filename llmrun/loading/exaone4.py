"""EXAONE 4.0 GGUFs (arch "exaone4") as llama.cpp's converter writes them
(conversion/exaone.py Exaone4Model: TextModel's keys, q/k rows as they are for its
NEOX RoPE, the window and a per-layer pattern of flags where the config has a window,
Llama 3 RoPE scaling as a rope_freqs tensor), read as src/models/exaone4.cpp reads
them: the sliding-window hybrid (global layers without RoPE) only in a 64-layer model
(the 32B), with a window of 4096 and load_swa_pattern(ml, 4) where the file has none
(older files of the 32B); every other model is all global layers that rotate, as
transformers runs a config without a window (the 1.2B's). EXAONE 4.5's text GGUFs
(conversion/exaone.py Exaone4_5_TextModel) end with nextn_predict_layers
multi-token-prediction layers, counted in block_count, which llama.cpp's inference skips
(TENSOR_SKIP) and so does llmrun.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import glm4_moe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "exaone4"
HYBRID_LAYERS = 64  # llama_model_exaone4::load_arch_hparams: the 32B's layer count
SLIDING_WINDOW = 4096  # its hparams.n_swa where the file has none
SWA_PATTERN = 4  # load_swa_pattern(ml, 4): every fourth layer global
# The post-sublayer norms (EXAONE 4 has no pre-norms), GGUF name -> HF module.
LAYER_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.ATTN_POST_NORM].split(".")[-1]: "post_attention_layernorm",
    TENSOR_NAMES[MODEL_TENSOR.FFN_POST_NORM].split(".")[-1]: "post_feedforward_layernorm",
}


def finish_config(
    gg: GGUFFile,
    config: dict[str, Any],
    layer_types: Callable[..., list[str]],
) -> None:
    """EXAONE 4's fields of the HF-style config that config_from_gguf built: the window
    and each layer's type, as llama.cpp decides them (`layer_types` is gguf_config's
    reader of llama.cpp's window pattern). Refuses what llama.cpp would run otherwise
    than transformers runs the model: a window outside a 64-layer model, a sliding RoPE
    base of its own; and partial RoPE. NextN prediction layers are left out."""
    meta = ArchMetadata.of(gg, ARCH)
    blocks, nextn = config["num_hidden_layers"], meta.get(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    if not isinstance(nextn, int) or isinstance(nextn, bool) or not 0 <= nextn < blocks:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.NEXTN_PREDICT_LAYERS)} is {nextn!r} of "
            f"{blocks} blocks: no layers are left to run"
        )
    layers = blocks - nextn
    config.update(num_hidden_layers=layers)
    config[glm4_moe.NEXTN] = nextn
    flags = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if nextn and isinstance(flags, list) and len(flags) == layers + nextn:
        # Flags for the MTP layers too: the trunk's come first.
        trunk = {meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN): flags[:layers]}
        meta = replace(meta, metadata={**meta.metadata, **trunk})
    rope = config["rope_parameters"]
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} is not the head size "
            f"{config['head_dim']}; EXAONE 4 rotates whole heads"
        )
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    if layers != HYBRID_LAYERS:
        if window:
            # The converter writes a window only for a config with one, whose global
            # layers transformers runs without RoPE; llama.cpp rotates them all here.
            raise UnsupportedError(
                f"{gg.path}: a {layers}-layer exaone4 file with a sliding window; llama.cpp "
                f"runs the window only in a {HYBRID_LAYERS}-layer model (the 32B) and every "
                "layer of this one as global with RoPE, and llmrun does not guess which the "
                "model was trained as"
            )
        config.update(sliding_window=None, layer_types=["full_attention"] * layers)
        return
    local_base = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if local_base is not None and local_base != rope["rope_theta"]:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.FREQ_BASE_SWA.format(arch=ARCH)} ({local_base}) differs "
            f"from {Keys.Rope.FREQ_BASE.format(arch=ARCH)} ({rope['rope_theta']}); EXAONE 4 "
            "has one RoPE base"
        )
    config.update(
        sliding_window=window or SLIDING_WINDOW,
        layer_types=layer_types(gg, meta, layers, SWA_PATTERN),
    )
