"""Kolibri-1 and Kolibri-1.1 checkpoints at the loader edge: the Hub's folders
(Aleph-Alpha/Kolibri-1, Aleph-Alpha/Kolibri-1.1) and transformers' save_pretrained ones,
under llmrun's names as transformers' conversion mapping ("kolibri1", and "kolibri1_1" its
copy: qwen2_moe's and three renames) reads them.

The Hub's keys hold the selection bias as moe.router.expert_bias and the norms after
each sublayer as post_attn_norm and post_ffn_norm, one tensor per expert and projection;
transformers 5 saves its names with the experts stacked (mlp.experts.gate_up_proj
[E, 2I, D], down_proj [E, D, I]), which are split here. llama.cpp has no converter for
Kolibri: folders only.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.loading import experts

MODEL_TYPES = ("kolibri1", "kolibri1_1")
# The Hub's name -> transformers' (and llmrun's), anywhere in a key.
_HUB_NAMES = {
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "post_attn_norm": "post_self_attn_layernorm",
    "post_ffn_norm": "post_mlp_layernorm",
}
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight_type: type
) -> dict[str, Any]:
    """A Kolibri folder's weights under llmrun's keys, stacked experts split."""
    renamed = {}
    for name, w in weights.items():
        for old, new in _HUB_NAMES.items():
            name = name.replace(old, new)
        renamed[name] = w
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 512)
    return experts.split_stacked(renamed, _STACKED, hidden, width, weight_type)
