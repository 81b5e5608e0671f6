"""OpenELM checkpoints and GGUFs, as llmrun/models/openelm.py's config and Llama's names.

Hugging Face folders (OpenELMForCausalLM, remote code) name the sizes model_dim,
num_transformer_layers, num_query_heads and num_kv_heads (one per layer), and give each
layer's feed-forward width as a multiple of model_dim (ffn_multipliers), rounded as
configuration_openelm.py's make_divisible rounds it to ffn_dim_divisor; RoPE's base is
rope_freq_constant, the RMSNorms' epsilon 1e-6 (modeling_openelm.py's default), and the
output matrix the token embedding where share_input_output_layers. Their keys
(transformer.token_embeddings, transformer.layers.N.attn.qkv_proj, attn.q_norm, attn.k_norm,
attn.out_proj, attn_norm, ffn_norm, ffn.proj_1 holding the gate's rows then the up
projection's, ffn.proj_2, transformer.norm) become Llama's.

llama.cpp's converter (conversion/openelm.py OpenELMModel) writes arch "openelm": the head
counts and feed-forward lengths as per-layer arrays, the RMS epsilon 1e-6, the head size as
key/value length and rope dimension count, proj_1 split into ffn_gate and ffn_up, q/k rows
as they are for its NEOX RoPE, no output matrix (src/models/openelm.cpp reads the token
embedding for it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = MODEL_TYPE = "openelm"
RMS_EPS = 1e-6  # OpenELMRMSNorm's default, which the checkpoints' modules keep
_RENAMES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^transformer\.token_embeddings\.", "model.embed_tokens."),
        (r"^transformer\.norm\.", "model.norm."),
        (r"^transformer\.layers\.", "model.layers."),
        (r"\.attn\.qkv_proj\.", ".self_attn.qkv_proj."),
        (r"\.attn\.q_norm\.", ".self_attn.q_norm."),
        (r"\.attn\.k_norm\.", ".self_attn.k_norm."),
        (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.ffn\.proj_2\.", ".mlp.down_proj."),
    )
)
_PROJ_1 = re.compile(r"^transformer\.layers\.(\d+)\.ffn\.proj_1\.weight$")


def make_divisible(value: float, divisor: int) -> int:
    """configuration_openelm.py's rounding of a width to a multiple of `divisor` (never
    below it, nor more than 10% under `value`), as llama.cpp's converter repeats it."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _per_layer(config: dict[str, Any], name: str, layers: int, where: Any) -> list:
    value = config.get(name)
    if not isinstance(value, list) or len(value) != layers:
        raise ModelFormatError(f"{where}: {name} is {value!r}, not one value per layer ({layers})")
    return value


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], path: Path, weight_type: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An OpenELM folder's config as llmrun's model reads it and its weights under Llama's
    keys (see the module's note)."""
    where = path / "config.json"
    if config.get("normalize_qk_projections") is False or config.get("ffn_with_glu") is False:
        raise UnsupportedError(
            f"{where}: an OpenELM without normalized q/k projections or a gated feed-forward "
            "is not supported (the released models have both, as llama.cpp requires)"
        )
    layers, hidden = config.get("num_transformer_layers"), config.get("model_dim")
    divisor = config.get("ffn_dim_divisor")
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, divisor)):
        raise ModelFormatError(
            f"{where}: num_transformer_layers, model_dim and ffn_dim_divisor are "
            f"{layers!r}, {hidden!r} and {divisor!r}, not all positive whole numbers"
        )
    multipliers = _per_layer(config, "ffn_multipliers", layers, where)
    widths = [make_divisible(m * hidden, divisor) for m in multipliers]
    canonical = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "head_dim": config.get("head_dim"),
        "vocab_size": config.get("vocab_size"),
        "num_query_heads": _per_layer(config, "num_query_heads", layers, where),
        "num_kv_heads": _per_layer(config, "num_kv_heads", layers, where),
        "intermediate_sizes": widths,
        "rms_norm_eps": RMS_EPS,
        "max_position_embeddings": config.get("max_context_length"),
        "rope_theta": config.get("rope_freq_constant", 10000),
        "tie_word_embeddings": config.get("share_input_output_layers", True),
        **{k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config},
    }
    renamed: dict[str, Any] = {}
    for name, weight in weights.items():
        proj_1 = _PROJ_1.match(name)
        if proj_1 is not None:
            layer = int(proj_1.group(1))
            tensor, width = weight.tensor, widths[layer] if layer < layers else 0
            if tensor.shape[0] != 2 * width:
                raise ModelFormatError(
                    f"{path}: {name} has {tensor.shape[0]} rows, not the gate's and up "
                    f"projection's {width} each"
                )
            prefix = f"model.layers.{layer}.mlp"
            renamed[f"{prefix}.gate_proj.weight"] = weight_type(tensor[:width])
            renamed[f"{prefix}.up_proj.weight"] = weight_type(tensor[width:])
            continue
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
        renamed[name] = weight
    return canonical, renamed


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """llmrun's OpenELM config of an openelm GGUF; rope_from_gguf is gguf_config's reader
    of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    head_dim = meta.require(Keys.Attention.KEY_LENGTH)
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Attention.VALUE_LENGTH)} differs from "
            f"{meta.name(Keys.Attention.KEY_LENGTH)}; llama.cpp's openelm asserts they agree"
        )

    def per_layer(template: str) -> list[int]:
        value = meta.require(template)
        value = value if isinstance(value, list) else [value] * layers
        if len(value) != layers:
            raise ModelFormatError(
                f"{gg.path}: {meta.name(template)} lists {len(value)} layers, not {layers}"
            )
        return value

    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{head_dim}; OpenELM turns whole heads"
        )
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "head_dim": head_dim,
        "vocab_size": vocab_size(gg, meta),
        "num_query_heads": per_layer(Keys.Attention.HEAD_COUNT),
        "num_kv_heads": per_layer(Keys.Attention.HEAD_COUNT_KV),
        "intermediate_sizes": per_layer(Keys.LLM.FEED_FORWARD_LENGTH),
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "rope_parameters": rope,
    }
