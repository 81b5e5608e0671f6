"""Phi-3.5-MoE at the loader edge: "phimoe" GGUFs as llama.cpp's converter writes them
(conversion/phi.py PhiMoeModel over Phi3MiniModel: the LayerNorms' epsilon as
layer_norm_rms_epsilon, LongRoPE's factors as the rope_factors_long/short tensors with
rope.scaling.attn_factor and original_context_length, q/k rows as they are, the experts
w1/w3/w2 stacked as ffn_gate/up/down_exps, biases as they are).

The file keeps the weights of transformers' model, which llmrun runs: LayerNorm with its
bias and the sparsemixer's routing (llmrun/models/phimoe.py). llama.cpp's graph
(src/models/phimoe.cpp, Phi-3's) differs from it: it normalizes by RMS (adding the
LayerNorms' biases) and weighs the top two of the router's softmax renormalized. The
sparsemixer's margin (router_jitter_noise) is not in the file: it is 0.01, the value of
Phi-3.5-MoE's config.json and transformers' default.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, layer_name

ARCH = MODEL_TYPE = "phimoe"
ROUTER_JITTER_NOISE = 0.01  # Phi-3.5-MoE's, transformers' PhimoeConfig default


# The mixture of experts, GGUF module (after "blk.N.") -> HF module (after
# "model.layers.N."), a stack's with an {expert} field; the rest has Llama's names.
MOE_NAMES = {
    layer_name(MODEL_TENSOR.FFN_GATE_INP): "block_sparse_moe.gate",
    layer_name(MODEL_TENSOR.FFN_GATE_EXP): "block_sparse_moe.experts.{expert}.w1",
    layer_name(MODEL_TENSOR.FFN_UP_EXP): "block_sparse_moe.experts.{expert}.w3",
    layer_name(MODEL_TENSOR.FFN_DOWN_EXP): "block_sparse_moe.experts.{expert}.w2",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF key of a phimoe layer's router or stack of experts, or None."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
        return None
    module = MOE_NAMES.get(parts[2])
    return None if module is None else f"model.layers.{parts[1]}.{module}.weight"


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """The experts' and biases' fields of a "phimoe" GGUF's config (`config` holds the
    common ones)."""
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: phimoe.expert_used_count is {used} and phimoe.expert_count {count}; "
            "a PhiMoE model routes each token to 1 to expert_count experts"
        )
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise ModelFormatError(
            f"{gg.path}: attention.key_length {config['head_dim']} is not embedding_length / "
            "head_count, as PhiMoE's heads are"
        )
    config.update(
        num_local_experts=count,
        num_experts_per_tok=used,
        router_jitter_noise=ROUTER_JITTER_NOISE,
        lm_head_bias="output.bias" in gg.tensors,
    )
