"""Qwen 1 (Qwen-1.8B/7B/14B/72B and their -Chat; the Hub's QWenLMHeadModel, model_type
"qwen"; llama.cpp's GGUF arch "qwen") at the loader edge, as the config and weights of
llmrun.models.qwen2: the published code (modeling_qwen.py) computes Qwen2's model (q/k/v
biases, none on the output projection, RMSNorms, RoPE on whole heads with halves turned,
SwiGLU) under other names.

A folder's config.json: kv_channels is the head width, intermediate_size twice the
feed-forward's width (each of w1 and w2 is intermediate_size / 2 wide), layer_norm_epsilon
the RMSNorms' epsilon, rotary_emb_base the RoPE base; its weights: transformer.wte,
transformer.h.N.{ln_1, attn.c_attn (all queries' rows, then keys', then values', with
their biases), attn.c_proj, ln_2, mlp.w1 (up), mlp.w2 (gate), mlp.c_proj}, transformer.ln_f,
lm_head. Its tokenizer is a tiktoken file llmrun does not read: a folder needs a
tokenizer.json beside it (a GGUF carries the vocabulary as a BPE one). The published
code's dynamic NTK RoPE and log-n query scaling (use_dynamic_ntk, use_logn_attn) act only
past seq_length tokens: the context is held to seq_length where either is on.

A GGUF as llama.cpp's converter writes it (conversion/qwen.py QwenModel): attn_qkv fused
with its bias, unpermuted (llama.cpp's NEOX RoPE), split here (as chatglm's);
feed_forward_length the config's intermediate_size (llama.cpp's tensors are half of it
wide); w1 as ffn_up, w2 as ffn_gate. llama.cpp requires attention.layer_norm_rms_epsilon
(which today's converter, writing Qwen's layer_norm_epsilon under the plain LayerNorm key,
leaves out: llama.cpp refuses such files, and so does llmrun).

Refused where the published code computes what this does not: biases on the output and
feed-forward projections (no_bias false), RoPE on part of each head (rotary_pct).
"""

from __future__ import annotations

import re
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "qwen", "qwen"
# A folder's names -> the model's (Qwen2's), in order.
_HF_RENAMES = (
    (re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
    (re.compile(r"^transformer\.h\."), "model.layers."),
    (re.compile(r"\.ln_1\."), ".input_layernorm."),
    (re.compile(r"\.ln_2\."), ".post_attention_layernorm."),
    (re.compile(r"\.attn\.c_proj\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.w1\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.w2\."), ".mlp.gate_proj."),
    (re.compile(r"\.mlp\.c_proj\."), ".mlp.down_proj."),
)
_FUSED = ".attn.c_attn."


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Qwen 1 folder's config in Qwen2's field names and its `weights` ({key: loader
    Weight}) under Qwen2's names, c_attn split (see the module docstring)."""
    if not config.get("no_bias", True):
        raise UnsupportedError(
            "Qwen with no_bias false (biases on the output and feed-forward projections) "
            "is not supported"
        )
    if config.get("rotary_pct", 1.0) != 1.0:
        raise UnsupportedError(
            f"Qwen with rotary_pct {config['rotary_pct']} is not supported (whole heads turned)"
        )
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("kv_channels") or hidden // heads
    context = config.get("max_position_embeddings") or config.get("seq_length")
    if config.get("use_dynamic_ntk", True) or config.get("use_logn_attn", True):
        context = min(context, config.get("seq_length") or context)
    config = {
        **config,
        "head_dim": head_dim,
        "intermediate_size": config["intermediate_size"] // 2,
        "rms_norm_eps": config.get("layer_norm_epsilon", 1e-6),
        "rope_theta": config.get("rotary_emb_base", 10000.0),
        "max_position_embeddings": context,
    }
    rows = heads * head_dim
    renamed = {}
    for key, weight in weights.items():
        if _FUSED in key:
            if weight.shape[0] != 3 * rows:
                raise ModelFormatError(
                    f"tensor {key} has {weight.shape[0]} rows, but {heads} heads of "
                    f"{head_dim} make {rows} for each of queries, keys and values"
                )
            base = key.replace("transformer.h.", "model.layers.", 1)
            for n, part in enumerate(("q_proj", "k_proj", "v_proj")):
                piece = weight.tensor.narrow(0, n * rows, rows)
                renamed[base.replace(_FUSED, f".self_attn.{part}.")] = weight_type(piece)
            continue
        for pattern, new in _HF_RENAMES:
            key = pattern.sub(new, key)
        renamed[key] = weight
    return config, renamed


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Qwen 1's fields of the HF-style config that config_from_gguf built, read as
    llama_model_qwen reads them: the feed-forward half of feed_forward_length wide, the
    q/k/v biases, RoPE on whole heads."""
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    if rotated != head_dim:
        raise UnsupportedError(
            f"{gg.path}: {ARCH}.rope.dimension_count is {rotated}, but Qwen turns whole "
            f"heads of {head_dim}"
        )
    config["intermediate_size"] //= 2
