"""Inkling 2 folders at the loader edge: the Hub's keys (which transformers' save_pretrained
also writes) renamed to transformers' module names, which llmrun's model carries.

transformers renames them on load (conversion_mapping.py, "inkling2_text"): the
attention's wq_du/wk_dv/wv_dv/wo_ud/gate_attn, the short convolutions (k_sconv, v_sconv,
attn_sconv, mlp_sconv), the block attention residuals' queries, kept together under
attn_res (attn_queries.i is layer i + 1's), and the stacked experts, whose w13_weight
interleaves gate and up rows (gate j, up j, ...). The unembedding is stored padded to
vocab_size; the model keeps its first unpadded_vocab_size rows.

An Inkling2ForConditionalGeneration folder (model_type "inkling2") holds the same text
weights under model.llm. beside its vision tower (model.visual.), which is not run.

The Hub's folder is MXFP8 (quantization_config quant_method "fp8", scale_fmt "ue8m0"):
FP8 E4M3 weights with one power-of-two scale byte per block (2^(byte - 127)), beside each
weight as <name>_scale_inv (experts: w13_weight_scale, w2_weight_scale). transformers keeps
them as FP8 blocks on a GPU (its kernels quantize the activations to FP8 too) and, on a
CPU, dequantizes them at load, w * scale per block (integrations/finegrained_fp8.py
Fp8Dequantize); llmrun dequantizes them so at load, exactly (an E4M3 value times a power of
two is a bf16 value), and computes in the compute dtype.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

TEXT_MODEL_TYPE = "inkling2_text"
MODEL_TYPES = (TEXT_MODEL_TYPE, "inkling2")
UNPADDED_VOCAB_SIZE = 200058  # Inkling2TextConfig's default (config.json leaves defaults out)

# The Hub's names -> transformers', after model.llm. (regex, replacement), in order.
_RENAMES = [
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^embed_norm\.", "embed_tokens.embed_norm."),
    (r"^attn_res\.attn_queries\.(\d+)$", None),  # layer index + 1: _attention_query
    (r"^attn_res\.mlp_queries\.(\d+)$", r"layers.\1.mlp_input.query"),
    (r"^attn_res\.output_query$", "final_input.query"),
    (r"\.mlp\.experts\.w13_weight$", ".mlp.experts.gate_up_proj"),
    (r"\.mlp\.experts\.w2_weight$", ".mlp.experts.down_proj"),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.attn\.", ".self_attn."),
    (r"self_attn\.wq_du\.", "self_attn.q_proj.linear."),
    (r"self_attn\.wk_dv\.", "self_attn.k_proj.linear."),
    (r"self_attn\.wv_dv\.", "self_attn.v_proj.linear."),
    (r"self_attn\.(k|v)_sconv\.", r"self_attn.\1_proj.sconv."),
    (r"self_attn\.rel_logits_proj\.", "self_attn.relative_position_bias."),
    (r"self_attn\.wr_du\.", "self_attn.relative_position_bias.linear."),
    (r"self_attn\.q_l2_clip\.", "self_attn.q_proj.norm."),
    (r"self_attn\.rel_l2_clip\.", "self_attn.relative_position_bias.norm."),
    (r"self_attn\.wo_ud\.", "self_attn.o_proj.linear."),
    (r"self_attn\.gate_attn\.", "self_attn.o_proj.gate_proj."),
    (r"self_attn\.attn_sink_proj\.", "self_attn.sink_proj."),
    (r"\.attn_sconv\.", ".post_attention_convolution."),
    (r"\.mlp_sconv\.", ".post_mlp_convolution."),
    (r"(convolution|sconv)\.weight$", r"\1.conv1d.weight"),
    (r"(convolution|sconv)\.static_w$", r"\1.static_weight"),
    (r"(convolution|sconv)\.weight_proj$", r"\1.weight_proj.weight"),
    (r"\.mlp_norm\.", ".post_attention_layernorm."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.(q|k|v)_input_norm\.", r".\1_input_layernorm."),
]
_COMPILED = [(re.compile(pattern), to) for pattern, to in _RENAMES]


def _text_name(name: str) -> str:
    """transformers' name (after model.) of a Hub key after model.llm."""
    for pattern, to in _COMPILED:
        match = pattern.search(name)
        if match is None:
            continue
        if to is None:
            return f"layers.{int(match[1]) + 1}.attention_input.query"
        name = pattern.sub(to, name)
    return name


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """An Inkling 2 folder's text config and weights under the model's names, and whether
    the folder had a vision tower."""
    weights = dequantized(config.get("quantization_config"), weights, weight_type)
    multimodal = config.get("model_type") == "inkling2"
    if multimodal:
        text = config.get("text_config") or {}  # transformers: every default
        if not isinstance(text, dict):
            raise ModelFormatError("an inkling2 config.json whose text_config is not an object")
        config = {**text, "model_type": TEXT_MODEL_TYPE}
    out = {}
    for name, w in weights.items():
        if name.startswith("model.visual."):
            continue
        if name == "model.llm.unembed.weight":
            rows = int(config.get("unpadded_vocab_size", UNPADDED_VOCAB_SIZE))
            if rows > w.shape[0]:
                raise ModelFormatError(
                    f"{name} has {w.shape[0]} rows, fewer than unpadded_vocab_size {rows}"
                )
            out["lm_head.weight"] = weight_type(w.tensor[:rows])
        elif name.startswith("model.llm."):
            key = "model." + _text_name(name.removeprefix("model.llm."))
            if key.endswith(".mlp.experts.gate_up_proj"):
                # [E, (gate j, up j) ..., H] -> [E, gate ..., up ..., H]
                t = w.tensor
                w = weight_type(t.unflatten(1, (-1, 2)).transpose(1, 2).reshape(t.shape))
            out[key] = w
        else:
            out[name] = w
    return config, out, multimodal


def dequantized(quant: Any, weights: dict[str, Any], weight_type: type) -> dict:
    """`weights` (the Hub's names) with each FP8 weight and its block scales (beside it as
    <name>_scale_inv or <name>_scale) turned into the floats they stand for: bf16 for
    power-of-two (ue8m0) scales, f32 for float ones. Expert stacks are dequantized as
    stored, gate and up rows interleaved: with blocks of one row, as MXFP8's are, those
    are the values transformers gets de-interleaving weights and scales first."""
    import torch  # here: llmrun list and show import this module without torch

    fp8 = [name for name, w in weights.items() if w.tensor.dtype == torch.float8_e4m3fn]
    if not quant and not fp8:
        return weights
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        raise UnsupportedError(
            f"Inkling 2 checkpoints quantized as {method!r} are not supported (only fp8: MXFP8)"
        )
    out = dict(weights)
    for name in fp8:
        scale_name = next(
            (f"{name}{s}" for s in ("_scale_inv", "_scale") if f"{name}{s}" in out), None
        )
        if scale_name is None:
            raise ModelFormatError(f"{name} is FP8 without its block scales ({name}_scale_inv)")
        scale = out.pop(scale_name).tensor
        if name.endswith("w13_weight") and scale.shape[-2:-1] != out[name].shape[-2:-1]:
            raise UnsupportedError(
                f"{name}: FP8 blocks of more than one row over interleaved gate and up rows"
            )
        out[name] = weight_type(_dequantize(name, out[name].tensor, scale))
    return out


def _dequantize(name: str, weight: Any, scale: Any) -> Any:
    """FP8 `weight` [..., rows, cols] times its per-block `scale` [..., rows / m, cols / n]
    (uint8: 2^(byte - 127), as ue8m0 stores it; else the floats themselves)."""
    import torch

    rows, cols = weight.shape[-2:]
    scale_rows, scale_cols = scale.shape[-2:] if scale.dim() >= 2 else (1, 1)
    if (
        scale.dim() not in (0, weight.dim())
        or scale.shape[:-2] != weight.shape[:-2]
        or rows % scale_rows
        or cols % scale_cols
    ):
        raise ModelFormatError(
            f"{name}: FP8 weight of shape {list(weight.shape)} with scales of shape "
            f"{list(scale.shape)}, not a grid of whole blocks"
        )
    if scale.dtype == torch.uint8:
        factors, dtype = (scale.float() - 127.0).exp2(), torch.bfloat16
    else:
        factors, dtype = scale.float(), torch.float32
    # [..., rows, cols] -> [..., scale_rows, m, scale_cols, n], one factor per block
    blocks = weight.float().reshape(
        *weight.shape[:-2], scale_rows, rows // scale_rows, scale_cols, cols // scale_cols
    )
    factors = factors.reshape(*weight.shape[:-2], scale_rows, 1, scale_cols, 1)
    return (blocks * factors).reshape(weight.shape).to(dtype)


def cache_shapes(text: dict[str, Any]) -> list[tuple[int, int]]:
    """Each layer's cached (KV heads, head_dim) of an Inkling 2 text config (torch-free,
    for `show`; Inkling2TextConfig's defaults): sliding layers' swa_ sizes, full layers'
    own."""
    layers = int(text.get("num_hidden_layers", 48))
    kinds = text.get("layer_types") or [
        "hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(layers)
    ]
    sliding = (int(text.get("swa_num_key_value_heads", 8)), int(text.get("swa_head_dim", 128)))
    full = (int(text.get("num_key_value_heads", 8)), int(text.get("head_dim", 128)))
    return [sliding if kind == "hybrid_sliding" else full for kind in kinds]
