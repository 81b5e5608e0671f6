"""InternLM2/2.5 checkpoints and GGUFs.

Hugging Face folders (modeling_internlm2.py, remote code) name the modules
model.tok_embeddings, model.layers.N.attention.wqkv / .wo, .feed_forward.w1 / w3 / w2,
.attention_norm, .ffn_norm, model.norm and output; hf_weights renames them to Llama's and
splits each wqkv, whose rows are grouped by KV head: each group holds its query heads'
rows, then its key head's, then its value head's ([KV heads, queries per KV head + 2,
head_dim, hidden]), as modeling_internlm2.py reads them and llama.cpp's converter splits
them.

llama.cpp's converter (conversion/internlm.py InternLM2Model) writes arch "internlm2":
TextModel's keys (no key length: heads of hidden / heads), the split attn_q, attn_k and
attn_v with the query and key rows permuted as a llama's (the loader undoes that), Llama's
tensor names for the rest; dynamic RoPE scaling as nothing (llama.cpp turns plain RoPE at
every position), linear scaling as it is. src/models/internlm2.cpp rotates whole heads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError
from llmrun.loading import exaone
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "internlm2"
_RENAMES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^model\.tok_embeddings\.", "model.embed_tokens."),
        (r"^output\.", "lm_head."),
        (r"\.attention\.wo\.", ".self_attn.o_proj."),
        (r"\.attention_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
        (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
        (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
    )
)
_WQKV = re.compile(r"^(model\.layers\.\d+)\.attention\.wqkv\.(weight|bias)$")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], path: Path, weight_type: type
) -> dict[str, Any]:
    """An InternLM2 folder's weights under Llama's names, each wqkv split into q_proj,
    k_proj and v_proj (see the module's note)."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    kv_heads = config.get("num_key_value_heads") or heads
    if not all(isinstance(n, int) and n > 0 for n in (heads, hidden, kv_heads)):
        raise ModelFormatError(
            f"{path}: config.json's hidden_size ({hidden!r}), num_attention_heads ({heads!r}) "
            f"and num_key_value_heads ({kv_heads!r}) are not the sizes of an InternLM2 model"
        )
    head_dim = hidden // heads
    if heads % kv_heads:
        raise ModelFormatError(
            f"{path}: {heads} attention heads cannot share {kv_heads} key/value heads"
        )
    renamed: dict[str, Any] = {}
    for name, weight in weights.items():
        fused = _WQKV.match(name)
        if fused is None:
            for pattern, replacement in _RENAMES:
                name = pattern.sub(replacement, name)
            renamed[name] = weight
            continue
        layer, kind = fused.groups()
        tensor = weight.tensor
        rows = (heads + 2 * kv_heads) * head_dim
        if tensor.shape[0] != rows:
            raise ModelFormatError(
                f"{path}: {name} has {tensor.shape[0]} rows, but {heads} query and {kv_heads} "
                f"key/value heads of {head_dim} make {rows}"
            )
        # [rows, ...] -> [KV heads, queries per KV head + 2, head_dim, ...]
        groups = tensor.view(kv_heads, heads // kv_heads + 2, head_dim, *tensor.shape[1:])
        parts = {
            "q_proj": groups[:, :-2],
            "k_proj": groups[:, -2],
            "v_proj": groups[:, -1],
        }
        for proj, part in parts.items():
            split = part.reshape(-1, *tensor.shape[1:])  # a copy: the rows are interleaved
            renamed[f"{layer}.self_attn.{proj}.{kind}"] = weight_type(split)
    return renamed


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """InternLM2's checks of the config config_from_gguf built: whole-head RoPE (llama.cpp
    asserts it), YaRN as llama.cpp applies it (exaone.check_rope)."""
    exaone.check_rope(gg, config, meta, "InternLM2")
