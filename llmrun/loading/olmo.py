"""OLMo 2 and OLMo 3 at the loader edge: llama.cpp writes both as arch "olmo2"
(conversion/olmo.py), OLMo 3 with a sliding window and a per-layer pattern, and reads
them as src/models/olmo2.cpp does: NEOX RoPE on unpermuted q/k, the window's layers
(load_swa_pattern(ml, 4) where the file lists none) rotated with the global base and
no scaling, the global layers with the file's scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import GGUFFile

ARCH = "olmo2"
MODEL_TYPES = ("olmo2", "olmo3")
SWA_PATTERN = 4  # llama_model_olmo2::load_arch_hparams: load_swa_pattern(ml, 4)
# The post-sublayer norms (OLMo 2 has no pre-norms), GGUF name -> HF module.
LAYER_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.ATTN_POST_NORM].split(".")[-1]: "post_attention_layernorm",
    TENSOR_NAMES[MODEL_TENSOR.FFN_POST_NORM].split(".")[-1]: "post_feedforward_layernorm",
}


def config_from_gguf(
    gg: GGUFFile,
    config: dict[str, Any],
    arch_key: Callable[..., Any],
    rope_from_gguf: Callable[..., dict[str, Any]],
    layer_types: Callable[..., list[str]],
) -> dict[str, Any]:
    """OLMo 2's (no window) or OLMo 3's (a window) config from an "olmo2" GGUF. `config`
    holds the common fields; arch_key reads "{arch}.NAME" keys; rope_from_gguf and
    layer_types are gguf_config's readers of the RoPE keys and of llama.cpp's window
    pattern."""

    def key(template: str, default: Any = None) -> Any:
        return gg.metadata.get(template.format(arch=ARCH), default)

    head_dim = config["head_dim"]
    rope = rope_from_gguf(gg, arch_key, head_dim, config["max_position_embeddings"])
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} is not the head size "
            f"{head_dim}; OLMo rotates whole heads"
        )
    window = key(Keys.Attention.SLIDING_WINDOW) or None
    if window is None:
        config.update(model_type="olmo2", rope_parameters=rope)
        return config
    local_base = key(Keys.Rope.FREQ_BASE_SWA)
    if local_base is not None and local_base != rope["rope_theta"]:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.FREQ_BASE_SWA.format(arch=ARCH)} ({local_base}) differs "
            f"from {Keys.Rope.FREQ_BASE.format(arch=ARCH)} ({rope['rope_theta']}); llama.cpp "
            "rotates OLMo 3's sliding layers with the global base, and llmrun does not guess "
            "which one the model was trained with"
        )
    local = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    config.update(
        model_type="olmo3",
        sliding_window=window,
        layer_types=layer_types(gg, key, config["num_hidden_layers"], SWA_PATTERN),
        rope_parameters={"full_attention": rope, "sliding_attention": local},
    )
    return config
