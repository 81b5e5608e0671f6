"""EXAONE 4.0 GGUFs (arch "exaone4") as llama.cpp's converter writes them
(conversion/exaone.py Exaone4Model: TextModel's keys, q/k rows as they are for its
NEOX RoPE, the window and a per-layer pattern of flags where the config has a window,
Llama 3 RoPE scaling as a rope_freqs tensor), read as src/models/exaone4.cpp reads
them: the sliding-window hybrid (global layers without RoPE) only in a 64-layer model
(the 32B), with a window of 4096 and load_swa_pattern(ml, 4) where the file has none
(older files of the 32B); every other model is all global layers that rotate, as
transformers runs a config without a window (the 1.2B's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
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
    base of its own; and NextN prediction layers and partial RoPE."""
    layers = config["num_hidden_layers"]
    meta = ArchMetadata.of(gg, ARCH)
    if meta.get(Keys.LLM.NEXTN_PREDICT_LAYERS, 0):
        raise UnsupportedError(
            f"{gg.path}: an exaone4 file with NextN prediction layers (EXAONE 4.5) is not supported"
        )
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
