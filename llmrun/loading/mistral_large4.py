"""Mistral Large 4 (mistral_large4) Hugging Face folders at the loader edge. Their
safetensors hold Mistral's native names (tok_embeddings, layers.N.attention.wq,
experts.E.w1, ssmax_scaling.s, lerope.alpha, output, vision_encoder.*: what
save_pretrained writes too), which transformers' conversion_mapping renames on load;
hf_names gives the language model's tensors transformers' names (the vision tower's are
read by llmrun.loading.pixtral_vision, so left out here). After the loader takes the
language model out (its text_config), hf_checkpoint gives the checkpoint as
llmrun.models.mistral_large4 takes it: stacked experts (of a folder saved in
transformers' own names) split into one module each, the multi-token-prediction head
(mtp_dspark.*, which transformers does not load) and any layers past num_hidden_layers
left out. llama.cpp has no converter for the family: no GGUF reading here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from llmrun.loading import deepseek2, experts, mistral_native

MODEL_TYPE, TEXT_MODEL_TYPE = "mistral_large4", "mistral_large4_text"
# The draft head's checkpoint keys, wherever they sit (transformers'
# _keys_to_ignore_on_load_unexpected: r"mtp_dspark\..*").
_MTP = re.compile(r"(?:^|\.)mtp_dspark\.")
# transformers' conversion_mapping for mistral_large4 and mistral_large4_text, in its
# order, from the native names (rooted at tok_embeddings, lerope, layers, norm, output) to
# the text model's (under model.*; the vision tower's are left out). Text q/k rows are
# stored as the model takes them: only the tower's are permuted.
_NATIVE_ROOTS = ("tok_embeddings.", "lerope.", "layers.", "norm.", "output.")
_RENAMES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^tok_embeddings\.", "model.embed_tokens."),
        (r"^lerope\.alpha$", "model.rotary_emb.alpha"),
        (r"^layers\.", "model.layers."),
        (r"^norm\.", "model.norm."),
        (r"^output\.", "lm_head."),
        (r"\.wo\.", ".o_proj."),
        (r"\.attention\.", ".self_attn."),
        (r"\.wq\.", ".q_proj."),
        (r"\.wkv_a_with_mqa\.", ".kv_a_proj_with_mqa."),
        (r"\.wkv_b\.", ".kv_b_proj."),
        (r"\.attention_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.kv_a_norm\.", ".kv_a_layernorm."),
        (r"\.feed_forward\.", ".mlp."),
        (r"\.gate\.", ".mlp.gate."),
        (r"\.experts\.", ".mlp.experts."),
        (r"\.shared_experts\.", ".mlp.shared_experts."),
        (r"\.w1\.", ".gate_proj."),
        (r"\.w2\.", ".down_proj."),
        (r"\.w3\.", ".up_proj."),
        (r"\.ssmax_scaling\.s$", ".softmax_scaling.scale"),
        (r"\.ssmax_scaling\.b$", ".softmax_scaling.bias"),
    )
)
_STACKED_EXPERTS = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?"
)


def hf_names(weights: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's weights, those under native names renamed to the language model's
    (transformers' names below model.*) and the vision tower's left out; tensors already
    under transformers' names (model.language_model.*, ...) kept as they are."""
    out = {}
    for name, w in weights.items():
        if name.startswith(mistral_native.VISION_PREFIXES):
            continue
        if name.startswith(_NATIVE_ROOTS):
            for pattern, replacement in _RENAMES:
                name = pattern.sub(replacement, name)
        out[name] = w
    return out


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], path: Path, weight_type: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The language model's config and weights (`weight_type`: the loader's Weight) as
    the model takes them. MLA caches one latent head: the config's num_key_value_heads
    means nothing, and would fail the loader's head count check."""
    config = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    weights = {k: w for k, w in weights.items() if not _MTP.search(k)}
    weights = deepseek2.hf_weights(weights, config, path)
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    return config, experts.split_stacked(weights, _STACKED_EXPERTS, hidden, width, weight_type)
