"""gpt-oss at the loader edge: its checkpoints' experts as llmrun's per-expert modules
(llmrun/models/gpt_oss.py), and a GGUF's metadata and tensor names as llama.cpp's
converter writes them (conversion/gpt_oss.py) and llama.cpp reads them
(src/models/openai-moe.cpp).

A Hugging Face directory holds each layer's experts fused, in one of two forms:
transformers' (experts.gate_up_proj [E, D, 2I], gate and up interleaved column by
column; experts.down_proj [E, I, D]; float), or the Hub's as OpenAI ships them, MXFP4
(experts.gate_up_proj_blocks [E, 2I, D/32, 16] and _scales [E, 2I, D/32], rows
interleaved likewise; down_proj_blocks and _scales [E, D, I/32, ...]). The MXFP4 ones
become GGML MXFP4 blocks, which hold the same codes and the same E8M0 scale bytes with
the scale before each block and the codes in another nibble order: one copy at load,
after which gate and up are views of every other row. A GGUF holds them split and
stacked already (ffn_{gate,up,down}_exps, their biases [E, rows]).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, vocab_size

if TYPE_CHECKING:
    import torch

ARCH = "gpt-oss"
MODEL_TYPE = "gpt_oss"
# llama.cpp's constants for what a gpt-oss GGUF cannot carry: the SwiGLU's alpha and limit
# (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE), its YaRN betas (llama-hparams.h: llama.cpp
# reads no key for them) and its sliding-window pattern (load_swa_pattern(ml, 2): even
# layers local).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
SWA_PATTERN = 2
MXFP4 = GGMLQuantizationType.MXFP4

_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks)?$"
)


# GGUF tensor (the part after blk.N., without .weight/.bias) -> llmrun's module.
_LAYER_NAMES = {
    TENSOR_NAMES[t].split(".")[-1]: name
    for t, name in [
        (MODEL_TENSOR.ATTN_NORM, "input_layernorm"),
        (MODEL_TENSOR.ATTN_POST_NORM, "post_attention_layernorm"),
        (MODEL_TENSOR.ATTN_Q, "self_attn.q_proj"),
        (MODEL_TENSOR.ATTN_K, "self_attn.k_proj"),
        (MODEL_TENSOR.ATTN_V, "self_attn.v_proj"),
        (MODEL_TENSOR.ATTN_OUT, "self_attn.o_proj"),
        (MODEL_TENSOR.FFN_GATE_INP, "mlp.router"),
    ]
}
_GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.norm",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
}
SINKS = TENSOR_NAMES[MODEL_TENSOR.ATTN_SINKS].split(".")[-1]
# The stacked experts: gate, up, down (gguf_config.EXPERT_STACKS' names).
EXPERT_STACKS = {
    TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_EXP].split(".")[-1]: "gate_proj",
    TENSOR_NAMES[MODEL_TENSOR.FFN_UP_EXP].split(".")[-1]: "up_proj",
    TENSOR_NAMES[MODEL_TENSOR.FFN_DOWN_EXP].split(".")[-1]: "down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a gpt-oss GGUF tensor (a stack of experts: a template
    with an `{expert}` field), or None if gpt-oss has no such tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name = f"model.layers.{parts[1]}", parts[2]
    if name == SINKS and suffix == "weight":
        return f"{layer}.self_attn.sinks"  # a Parameter of its own; the converter adds .weight
    if name in EXPERT_STACKS:
        return f"{layer}.mlp.experts.{{expert}}.{EXPERT_STACKS[name]}.{suffix}"
    if name in _LAYER_NAMES:
        return f"{layer}.{_LAYER_NAMES[name]}.{suffix}"
    return None


def config_from_gguf(gg, rope_from_gguf, layer_types) -> dict[str, Any]:
    """An HF-style gpt_oss config from a GGUF's metadata, read as llama.cpp reads it
    (llama_model_openai_moe::load_arch_hparams and the general keys). `rope_from_gguf`
    and `layer_types` are gguf_io's readers of the RoPE keys and of a sliding-window
    pattern."""
    path = gg.path
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = meta.require(Keys.Attention.HEAD_COUNT)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    experts = meta.require(Keys.LLM.EXPERT_COUNT)
    used = meta.require(Keys.LLM.EXPERT_USED_COUNT)
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=ARCH)} differs "
                "between layers, which llmrun does not support"
            )
        width = width[0]
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if rope["rope_type"] == "yarn":
        # llama.cpp's YaRN: the betas it defaults to, the correction range rounded to whole
        # dimensions (ggml_rope_yarn_corr_dims), and the attention factor of the scale
        # (get_mscale) times rope.scaling.attn_factor.
        factor = rope["factor"]
        rope.update(beta_fast=YARN_BETA_FAST, beta_slow=YARN_BETA_SLOW, truncate=True)
        mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        rope["attention_factor"] = mscale * meta.get(Keys.Rope.SCALING_ATTN_FACTOR, 1.0)
    base_swa = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if base_swa is not None and base_swa != rope["rope_theta"]:
        raise UnsupportedError(
            f"{path}: {Keys.Rope.FREQ_BASE_SWA.format(arch=ARCH)} differs from "
            f"{Keys.Rope.FREQ_BASE.format(arch=ARCH)}; llmrun's gpt-oss has one RoPE base"
        )
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads),
        "head_dim": head_dim,
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "sliding_window": meta.require(Keys.Attention.SLIDING_WINDOW),
        "layer_types": layer_types(gg, meta, layers, SWA_PATTERN),
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": SWIGLU_LIMIT,
        "attention_bias": True,
        "tie_word_embeddings": TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
        "rope_parameters": rope,
    }


# ---- Hugging Face directories ---------------------------------------------------------


def _ggml_codes(blocks: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 code bytes [..., 16] (byte i: code 2i low, 2i + 1 high) in GGML's
    order (byte i: code i low, 16 + i high)."""
    import torch  # here: the GGUF metadata mapping above must not import torch

    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., 32] in order
    return codes[..., :16] | codes[..., 16:] << 4


def mxfp4_from_hub(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """The Hub's MXFP4 experts (blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G])
    as GGML MXFP4 rows uint8 [E, rows, G * 17], expert by expert (one copy)."""
    import torch

    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.dim() != 4
        or blocks.shape[-1] != 16
        or tuple(scales.shape) != tuple(blocks.shape[:3])
    ):
        raise ModelFormatError(
            f"{name}_blocks {blocks.dtype} {list(blocks.shape)} and _scales {scales.dtype} "
            f"{list(scales.shape)} are not MXFP4 experts (uint8 [E, rows, G, 16] and [E, rows, G])"
        )
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, rows, groups, 17, dtype=torch.uint8)
    for e in range(experts):
        out[e, :, :, 0] = scales[e]
        out[e, :, :, 1:] = _ggml_codes(blocks[e])
    return out.view(experts, rows, groups * 17)


def hf_weights(weights: dict, config: dict[str, Any], weight_type) -> dict:
    """A gpt-oss HF checkpoint's tensors ({key: Weight}) under llmrun's keys: every
    layer's fused experts split into each expert's gate, up and down projections and
    biases (the rest pass as they are). `weight_type` is the loader's Weight."""
    out, fused = {}, {}
    for key, w in weights.items():
        m = _EXPERT.match(key) or _EXPERT.match(key.removesuffix("_scales"))
        if m is None:
            out[key] = w
        else:
            fused[key] = w
    prefixes = sorted({_EXPERT.match(k.removesuffix("_scales")).group(1) for k in fused})
    for prefix in prefixes:
        out.update(_layer_experts(prefix, fused, config, weight_type))
    return out


def _layer_experts(prefix: str, fused: dict, config: dict[str, Any], weight_type) -> dict:
    count, width, dim = (
        config["num_local_experts"],
        config["intermediate_size"],
        config["hidden_size"],
    )
    out = {}

    def take(name: str) -> torch.Tensor:
        w = fused.get(f"{prefix}.{name}")
        if w is None:
            raise ModelFormatError(f"tensor {prefix}.{name} is missing")
        return w.tensor

    def put(proj: str, kind: str, tensors, ggml_type=None, shape=()) -> None:
        for e in range(count):
            out[f"{prefix}.{e}.{proj}.{kind}"] = weight_type(
                tensors[e], ggml_type, shape, expert=ggml_type is not None
            )

    def check(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise ModelFormatError(
                f"tensor {prefix}.{name} has shape {list(t.shape)}, but the config implies "
                f"{list(shape)} ({count} experts, hidden_size {dim}, intermediate_size {width})"
            )
        return t

    for proj, rows, cols in (("gate_up_proj", 2 * width, dim), ("down_proj", dim, width)):
        bias = check(take(f"{proj}_bias"), f"{proj}_bias", (count, rows))
        if f"{prefix}.{proj}_blocks" in fused:
            blocks, scales = take(f"{proj}_blocks"), take(f"{proj}_scales")
            check(blocks, f"{proj}_blocks", (count, rows, cols // 32, 16))
            raw = mxfp4_from_hub(blocks, scales, f"{prefix}.{proj}")  # [E, rows, row bytes]
            if proj == "down_proj":
                put("down_proj", "weight", raw, MXFP4, (dim, width))
            else:  # rows interleaved: gate, up, gate, up, ...
                put("gate_proj", "weight", raw[:, 0::2], MXFP4, (width, dim))
                put("up_proj", "weight", raw[:, 1::2], MXFP4, (width, dim))
        else:
            weight = check(take(proj), proj, (count, cols, rows))  # x @ W: [E, in, out]
            if proj == "down_proj":
                put("down_proj", "weight", weight.transpose(1, 2).contiguous())
            else:  # columns interleaved: gate, up, gate, up, ...
                put("gate_proj", "weight", weight[:, :, 0::2].transpose(1, 2).contiguous())
                put("up_proj", "weight", weight[:, :, 1::2].transpose(1, 2).contiguous())
        if proj == "down_proj":
            put("down_proj", "bias", bias)
        else:
            put("gate_proj", "bias", bias[:, 0::2].contiguous())
            put("up_proj", "bias", bias[:, 1::2].contiguous())
    return out
