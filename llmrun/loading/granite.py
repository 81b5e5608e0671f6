"""IBM Granite 3.x at the loader edge: a GGUF's Granite keys as llama.cpp's converter
writes them (conversion/granite.py) and llama.cpp reads them (src/models/granite.cpp,
granite-moe.cpp), and the Hub's fused MoE tensors split into llmrun's per-expert modules
(llmrun/models/granitemoe.py).

llama.cpp writes GraniteForCausalLM as arch "granite" and both GraniteMoeForCausalLM and
GraniteMoeSharedForCausalLM as "granitemoe" (the shared expert: ffn_*_shexp tensors and
expert_shared_feed_forward_length), with Llama's permuted q/k rows, the experts' fused
gate/up rows split into ffn_gate_exps and ffn_up_exps, and the muP multipliers under the
general *_scale keys. Granite 4's sliding-window models (GraniteSWAForCausalLM and
GraniteMoeSWAForCausalLM, both "granite_swa": src/models/granite-swa.cpp) add the
sliding-window pattern, a rope_pattern for NoPE layers, attention sinks (attn_sinks) and,
with experts, the routed experts' gate/up stack and the shared expert's gate/up rows kept
fused (ffn_gate_up_exps, ffn_up_shexp: gate rows, then up rows). Granite 4's hybrid
Mamba-2 models ("granitehybrid") have a module of their own (granitehybrid.py); the
adapter variant is another architecture, refused by name.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

SWA_ARCH = "granite_swa"
ARCHS = ("granite", "granitemoe", SWA_ARCH)  # GGUF architectures; Llama's q/k permutation
SWA_TYPES = ("granite_swa", "granitemoe_swa")  # HF model_types of SWA_ARCH, dense and MoE
MOE_TYPES = ("granitemoe", "granitemoeshared", "granitemoe_swa")  # HF model_types with experts
# Granite architectures llama.cpp writes that llmrun does not run, and what they are.
REFUSED = {"graniteswitch": "Granite Switch (per-token LoRA adapters)"}
# GGUF tensors of SWA_ARCH beyond Llama's, by their HF module in a layer.
SWA_LAYER_NAMES = {"attn_sinks": "self_attn.sinks"}
# Not in the gguf package this project pins: llama.cpp's LLM_KV_ATTENTION_ROPE_PATTERN and
# LLM_KV_DEEPSTACK_MAPPING (src/llama-arch.cpp).
ROPE_PATTERN = "{arch}.attention.rope_pattern"
DEEPSTACK_MAPPING = "{arch}.deepstack_mapping"
SHARED_UP = "mlp.shared_expert.up_proj.weight"  # SWA_ARCH's fused gate/up rows, by hf_name
SINKS = "self_attn.sinks.weight"  # hf_name's of attn_sinks.weight: the parameter is .sinks


def refuse(gg: GGUFFile) -> None:
    """UnsupportedError naming a Granite architecture that llmrun does not run."""
    what = REFUSED.get(gg.architecture)
    if what is not None:
        raise UnsupportedError(
            f"{gg.path}: architecture {gg.architecture!r} ({what}) is not supported; "
            f"llmrun runs Granite 3.x ({', '.join(ARCHS)})"
        )


def update_config(gg: GGUFFile, config: dict[str, Any]) -> None:
    """Add a granite/granitemoe GGUF's Granite fields to the HF-style `config` (which
    holds the common ones): the multipliers, llama.cpp's defaults where a key is absent
    (load_arch_hparams: logit_scale required; embedding and residual scales 0, meaning
    none; attention scale 0, meaning head_dim^-0.5), and the experts where
    expert_count is set, whatever the arch name (llama.cpp's granite graph runs either).
    A dense granite GGUF with deepstack_mapping is Granite 4 Vision's language model
    (granite4_vision_text, the decoder layers its images enter)."""
    arch = gg.architecture
    meta = ArchMetadata.of(gg)
    logits = meta.require(Keys.LLM.LOGIT_SCALE)
    if not logits:
        raise ModelFormatError(f"{gg.path}: {meta.name(Keys.LLM.LOGIT_SCALE)} is 0")
    if arch != SWA_ARCH and meta.get(Keys.Rope.SCALING_FINETUNED, True) is False:
        # llama.cpp's granite reads it as "use RoPE" (Granite 4's NoPE models); granite_swa
        # says which layers rotate in rope_pattern (finish_swa_config).
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.Rope.SCALING_FINETUNED)} is false: a Granite model "
            "without RoPE (NoPE), which llmrun does not support"
        )
    config.update(
        model_type="granite",
        logits_scaling=logits,
        embedding_multiplier=meta.get(Keys.LLM.EMBEDDING_SCALE) or 1.0,
        residual_multiplier=meta.get(Keys.LLM.RESIDUAL_SCALE) or 1.0,
        attention_multiplier=meta.get(Keys.Attention.SCALE) or config["head_dim"] ** -0.5,
        mlp_bias="blk.0.ffn_gate.bias" in gg.tensors,
    )
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    if arch == "granite" and meta.name(DEEPSTACK_MAPPING) in gg.metadata and not count:
        config.update(model_type="granite4_vision_text", image_layers=_image_layers(gg, meta))
    if not count:
        return
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not isinstance(used, int) or not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    # llama.cpp's granite graph: softmax gating, renormalized top-k weights, unscaled,
    # experts feed_forward_length wide; it reads no gating, norm or scale key for it.
    shared = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
    config.update(
        model_type="granitemoeshared" if shared else "granitemoe",
        num_local_experts=count,
        num_experts_per_tok=used,
        shared_intermediate_size=shared,
    )


# The Hub's (and transformers 5's) fused MoE tensors of a layer, after "model.layers.N.".
_FUSED = re.compile(
    r"(model\.layers\.\d+)\.(block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj"
    r"|output_linear\.weight|experts\.down_proj|router\.layer\.weight|router\.weight)"
    r"|shared_mlp\.(?:input_linear|output_linear)\.weight)$"
)


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A granitemoe/granitemoeshared checkpoint's weights under llmrun's names: the
    router as mlp.gate, each expert's rows of the fused tensors as views
    mlp.experts.N.{gate,up,down}_proj (input_linear [E, 2I, D]: gate rows, then up rows,
    as transformers chunks them), the shared expert's likewise. `weight_type` wraps a
    tensor (loader.Weight)."""
    out = {}
    for key, w in weights.items():
        match = _FUSED.match(key)
        if match is None:
            out[key] = w
            continue
        layer, part = match.groups()
        mlp = f"{layer}.mlp"
        tensor = w.tensor
        if part.startswith("block_sparse_moe.router"):
            out[f"{mlp}.gate.weight"] = w
        elif part.startswith("shared_mlp.input_linear"):
            gate, up = _halves(tensor, key, config.get("shared_intermediate_size"), 0)
            out[f"{mlp}.shared_expert.gate_proj.weight"] = weight_type(gate)
            out[f"{mlp}.shared_expert.up_proj.weight"] = weight_type(up)
        elif part.startswith("shared_mlp.output_linear"):
            out[f"{mlp}.shared_expert.down_proj.weight"] = w
        elif part.endswith(("input_linear.weight", "gate_up_proj")):
            gate, up = _halves(tensor, key, config.get("intermediate_size"), 1)
            for e in range(tensor.shape[0]):
                out[f"{mlp}.experts.{e}.gate_proj.weight"] = weight_type(gate[e])
                out[f"{mlp}.experts.{e}.up_proj.weight"] = weight_type(up[e])
        else:
            if tensor.dim() != 3:
                raise ModelFormatError(
                    f"{key} has shape {list(tensor.shape)}: the experts' down projections "
                    "are [experts, hidden, width]"
                )
            for e in range(tensor.shape[0]):
                out[f"{mlp}.experts.{e}.down_proj.weight"] = weight_type(tensor[e])
    return out


def _image_layers(gg: GGUFFile, meta: ArchMetadata) -> list[int]:
    """Granite 4 Vision's decoder layers that take the image streams in, in stream order,
    from deepstack_mapping as llama.cpp's converter writes it (one entry a layer: the
    stream added before it, -1 none) and llama.cpp reads it: stream 0 is the image token's
    input embedding, the converter's -1 at layer 0 (src/models/granite.cpp)."""
    key = meta.name(DEEPSTACK_MAPPING)
    mapping = gg.metadata[key]
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    streams = sorted((k, i) for i, k in enumerate(mapping) if isinstance(k, int) and k >= 0)
    ok = (
        isinstance(mapping, list)
        and len(mapping) == layers
        and all(isinstance(k, int) and k >= -1 for k in mapping)
        and mapping[0] == -1
        and [k for k, _ in streams] == list(range(1, len(streams) + 1))
        and [i for _, i in streams] == sorted(i for _, i in streams)
    )
    if not ok:
        raise ModelFormatError(
            f"{gg.path}: {key} is {mapping!r}, not one entry a layer numbering streams 1.. "
            "in layer order after the input's (-1 at layer 0)"
        )
    return [0, *(i for _, i in streams)]


def _halves(tensor: Any, key: str, width: int | None, dim: int) -> tuple[Any, Any]:
    """The gate and up rows of a fused [.., 2 * width, hidden] tensor (rows on `dim`)."""
    if tensor.dim() != dim + 2 or width is None or tensor.shape[dim] != 2 * width:
        raise ModelFormatError(
            f"{key} has shape {list(tensor.shape)}, but the config implies gate and up "
            f"rows of width {width} stacked ({2 * (width or 0)} rows)"
        )
    return tensor.narrow(dim, 0, width), tensor.narrow(dim, width, width)


def finish_swa_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Complete a granite_swa GGUF's config (update_config's, with its RoPE settings) as
    llama.cpp's granite-swa reads the file: the sliding window and each layer's kind
    (both required), and which layers rotate (rope_pattern; absent, all), which
    transformers writes as layer_rope_theta (0: no RoPE); with experts, granitemoe_swa.
    The language model of Granite 4 Vision (deepstack_mapping) is refused."""
    arch, path = gg.architecture, gg.path
    if meta.name(DEEPSTACK_MAPPING) in gg.metadata:
        raise UnsupportedError(
            f"{path}: {meta.name(DEEPSTACK_MAPPING)} is set: the language model of Granite 4 "
            "Vision, whose layers take in image features; llmrun runs Granite 4's text models"
        )
    rope = config["rope_parameters"]
    if "partial_rotary_factor" in rope:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size; llama.cpp's "
            f"{arch} rotates whole heads"
        )
    layers = config["num_hidden_layers"]
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    if not isinstance(window, int) or window <= 0:
        raise ModelFormatError(
            f"{path}: metadata {meta.name(Keys.Attention.SLIDING_WINDOW)} is {window!r}, not the "
            f"positive window {arch} needs"
        )
    sliding = _layer_flags(gg, meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN), layers, None)
    rotates = _layer_flags(gg, meta.name(ROPE_PATTERN), layers, True)
    theta = rope["rope_theta"]
    config.update(
        model_type="granitemoe_swa" if config.get("num_local_experts") else "granite_swa",
        sliding_window=window,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        layer_rope_theta=[theta if r else 0.0 for r in rotates],
    )


def _layer_flags(gg: GGUFFile, full_key: str, layers: int, default: bool | None) -> list[bool]:
    """A per-layer array of booleans (or 0/1) under `full_key`; absent, `default` for
    every layer (None: the key is required)."""
    value = gg.metadata.get(full_key)
    if value is None and default is not None:
        return [default] * layers
    if (
        not isinstance(value, list)
        or len(value) != layers
        or any(not isinstance(v, int) or v not in (0, 1) for v in value)
    ):
        shown = "missing" if value is None else repr(value)
        raise ModelFormatError(
            f"{gg.path}: metadata {full_key!r} is {shown}, not a true/false value for each "
            f"of the {layers} layers"
        )
    return [bool(v) for v in value]


def swa_gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A granite_swa GGUF's tensors as the model holds them: the sinks under the
    attention's `sinks`, the shared expert's fused ffn_up_shexp [2 * width, hidden]
    (gate rows, then up rows, as llama.cpp's swiglu halves it) as its gate_proj and
    up_proj, views of the file's rows. `weight_type` wraps a tensor (loader.Weight)."""
    out = {}
    width = config.get("shared_intermediate_size")
    for key, w in weights.items():
        if key.endswith(SINKS):
            out[key.removesuffix(".weight")] = w
            continue
        if not key.endswith(SHARED_UP):
            out[key] = w
            continue
        if not width or w.shape[0] != 2 * width:
            raise ModelFormatError(
                f"tensor {key} (ffn_up_shexp) has shape {list(w.shape)}, but the shared "
                f"expert's gate and up rows of width {width} are fused there"
            )
        shape = (width, *w.shape[1:])
        gate, up = w.tensor.narrow(0, 0, width), w.tensor.narrow(0, width, width)
        out[key.replace("up_proj", "gate_proj")] = weight_type(gate, w.ggml_type, shape)
        out[key] = weight_type(up, w.ggml_type, shape)
    return out
