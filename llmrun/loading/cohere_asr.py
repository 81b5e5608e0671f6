"""Cohere Transcribe at the loader edge: a Hugging Face folder (model_type "cohere_asr")
whose tensors carry NeMo's names (the Hub's, and what transformers' save_pretrained writes
back), renamed to CohereAsrForConditionalGeneration's as transformers' conversion mapping
renames them; the checkpoint's own featurizer (preprocessor.featurizer.*) is not read (the
features are the feature extractor's, llmrun.cohere_asr). And what `show` says of one.

Reference: transformers/conversion_mapping.py ("cohere_asr").
"""

from __future__ import annotations

import re
from typing import Any

MODEL_TYPE = "cohere_asr"
# NeMo's names -> transformers', applied in order as the conversion mapping applies them.
_RENAMES = [
    (r"encoder\.pre_encode\.conv\.", "encoder.subsampling.layers."),
    (r"encoder\.pre_encode\.out\.", "encoder.subsampling.linear."),
    (r"transf_decoder\._embedding\.position_embedding\.pos_enc", "decoder.pos_emb.weight"),
    (r"transf_decoder\._embedding\.token_embedding", "decoder.embed_tokens"),
    (r"transf_decoder\._embedding\.layer_norm", "decoder.embedding_layernorm"),
    (r"transf_decoder\._decoder\.final_layer_norm", "decoder.norm"),
    (r"transf_decoder\._decoder\.layers", "decoder.layers"),
    (r"encoder_decoder_proj\.", "decoder.proj."),
    (r"encoder\.(.+)\.self_attn\.linear_q", r"encoder.\1.self_attn.q_proj"),
    (r"encoder\.(.+)\.self_attn\.linear_k", r"encoder.\1.self_attn.k_proj"),
    (r"encoder\.(.+)\.self_attn\.linear_v", r"encoder.\1.self_attn.v_proj"),
    (r"encoder\.(.+)\.self_attn\.linear_out", r"encoder.\1.self_attn.o_proj"),
    (r"encoder\.(.+)\.self_attn\.linear_pos", r"encoder.\1.self_attn.relative_k_proj"),
    (r"encoder\.(.+)\.self_attn\.pos_bias_u", r"encoder.\1.self_attn.bias_u"),
    (r"encoder\.(.+)\.self_attn\.pos_bias_v", r"encoder.\1.self_attn.bias_v"),
    (r"decoder\.(.+)\.first_sub_layer\.query_net", r"decoder.\1.self_attn.q_proj"),
    (r"decoder\.(.+)\.first_sub_layer\.key_net", r"decoder.\1.self_attn.k_proj"),
    (r"decoder\.(.+)\.first_sub_layer\.value_net", r"decoder.\1.self_attn.v_proj"),
    (r"decoder\.(.+)\.first_sub_layer\.out_projection", r"decoder.\1.self_attn.o_proj"),
    (r"\.second_sub_layer\.query_net", ".encoder_attn.q_proj"),
    (r"\.second_sub_layer\.key_net", ".encoder_attn.k_proj"),
    (r"\.second_sub_layer\.value_net", ".encoder_attn.v_proj"),
    (r"\.second_sub_layer\.out_projection", ".encoder_attn.o_proj"),
    (r"\.third_sub_layer\.dense_in", ".mlp.fc1"),
    (r"\.third_sub_layer\.dense_out", ".mlp.fc2"),
    (r"\.layer_norm_1\.", ".input_layernorm."),
    (r"\.layer_norm_2\.", ".post_attention_layernorm."),
    (r"\.layer_norm_3\.", ".final_layernorm."),
    (r"\.conv\.batch_norm", ".conv.norm"),
    (r"log_softmax\.mlp\.layer0", "proj_out"),
]
_FEATURIZER = "preprocessor.featurizer."


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors under CohereAsrForConditionalGeneration's names (NeMo's
    renamed; transformers' own kept), under `model.` where a file leaves it out."""
    renamed = {}
    for name, tensor in weights.items():
        if _FEATURIZER in name:
            continue
        for old, new in _RENAMES:
            name = re.sub(old, new, name)
        if name.startswith(("encoder.", "decoder.")):
            name = "model." + name
        renamed[name] = tensor
    return renamed


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Cohere Transcribe folder: speech recognition, its
    layers, and its decoder's positions as the context length."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    # CohereAsrConfig's encoder_config defaults where the file leaves them out.
    encoder = {"num_hidden_layers": 48, "num_mel_bins": 128, **(config.get("encoder_config") or {})}
    return {
        "speech_recognition": (
            f"speech recognition: {encoder['num_hidden_layers']} encoder (FastConformer) "
            f"and {config.get('num_hidden_layers')} decoder layers, "
            f"{encoder['num_mel_bins']} mel bins"
        ),
        "context_length": config.get("max_position_embeddings"),
        "embedding_model": False,
    }
