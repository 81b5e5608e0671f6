"""IBM Granite 3.x at the loader edge: a GGUF's Granite keys as llama.cpp's converter
writes them (conversion/granite.py) and llama.cpp reads them (src/models/granite.cpp,
granite-moe.cpp), and the Hub's fused MoE tensors split into llmrun's per-expert modules
(llmrun/models/granitemoe.py).

llama.cpp writes GraniteForCausalLM as arch "granite" and both GraniteMoeForCausalLM and
GraniteMoeSharedForCausalLM as "granitemoe" (the shared expert: ffn_*_shexp tensors and
expert_shared_feed_forward_length), with Llama's permuted q/k rows, the experts' fused
gate/up rows split into ffn_gate_exps and ffn_up_exps, and the muP multipliers under the
general *_scale keys. Granite 4's hybrid Mamba-2 models ("granitehybrid") have a module of
their own (granitehybrid.py); the sliding-window and adapter variants are other
architectures, refused by name.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCHS = ("granite", "granitemoe")  # GGUF architectures; Llama's q/k permutation
MOE_TYPES = ("granitemoe", "granitemoeshared")  # HF model_types with experts
# Granite architectures llama.cpp writes that llmrun does not run, and what they are.
REFUSED = {
    "granite_swa": "Granite with sliding-window attention layers",
    "graniteswitch": "Granite Switch (per-token LoRA adapters)",
}


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
    expert_count is set, whatever the arch name (llama.cpp's granite graph runs either)."""
    arch = gg.architecture

    def key(template: str, default: Any = None) -> Any:
        return gg.metadata.get(template.format(arch=arch), default)

    def name(template: str) -> str:
        return template.format(arch=arch)

    logits = key(Keys.LLM.LOGIT_SCALE)
    if logits is None:
        raise ModelFormatError(f"{gg.path}: metadata {name(Keys.LLM.LOGIT_SCALE)!r} is missing")
    if not logits:
        raise ModelFormatError(f"{gg.path}: {name(Keys.LLM.LOGIT_SCALE)} is 0")
    if key(Keys.Rope.SCALING_FINETUNED, True) is False:
        # llama.cpp's granite reads it as "use RoPE" (Granite 4's NoPE models).
        raise UnsupportedError(
            f"{gg.path}: {name(Keys.Rope.SCALING_FINETUNED)} is false: a Granite model "
            "without RoPE (NoPE), which llmrun does not support"
        )
    config.update(
        model_type="granite",
        logits_scaling=logits,
        embedding_multiplier=key(Keys.LLM.EMBEDDING_SCALE) or 1.0,
        residual_multiplier=key(Keys.LLM.RESIDUAL_SCALE) or 1.0,
        attention_multiplier=key(Keys.Attention.SCALE) or config["head_dim"] ** -0.5,
        mlp_bias="blk.0.ffn_gate.bias" in gg.tensors,
    )
    count = key(Keys.LLM.EXPERT_COUNT, 0)
    if not count:
        return
    used = key(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    # llama.cpp's granite graph: softmax gating, renormalized top-k weights, unscaled,
    # experts feed_forward_length wide; it reads no gating, norm or scale key for it.
    shared = key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
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


def _halves(tensor: Any, key: str, width: int | None, dim: int) -> tuple[Any, Any]:
    """The gate and up rows of a fused [.., 2 * width, hidden] tensor (rows on `dim`)."""
    if tensor.dim() != dim + 2 or width is None or tensor.shape[dim] != 2 * width:
        raise ModelFormatError(
            f"{key} has shape {list(tensor.shape)}, but the config implies gate and up "
            f"rows of width {width} stacked ({2 * (width or 0)} rows)"
        )
    return tensor.narrow(dim, 0, width), tensor.narrow(dim, width, width)
