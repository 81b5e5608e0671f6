"""Nomic BERT at the loader edge: "nomic-bert" GGUFs as llama.cpp's converter writes them
(conversion/bert.py NomicBertModel) and src/models/bert.cpp reads them, and the Hub's
checkpoints (nomic-ai/nomic-embed-text-v1.5: its own config fields and module names)
under transformers 5's names (llmrun/models/nomic_bert.py).

The converter reads only the Hub's files: it requires a post-norm, bias-free SwiGLU model
with RoPE over whole heads, not interleaved and not scaled; writes TextModel's keys (its
context length the trained one, 2048 for v1 and v1.5), rope.freq_base from
rotary_emb_base, attention.layer_norm_epsilon, attention.causal false, a token type count;
keeps Wqkv fused (attn_qkv: rows of queries, keys, values), fc11 as ffn_up and fc12 as
ffn_gate. llama.cpp turns queries and keys by NEOX RoPE (half-split), base 10000 where the
file names none, and computes silu(gate(x)) * up(x).

nomic-embed-text-v2-moe (the Hub's moe_every_n_layers, num_experts, moe_top_k) is written
as "nomic-bert-moe": the converter requires activation_function "gelu" and the biases
(qkv_proj_bias, mlp_fc1_bias, mlp_fc2_bias), takes the context as 512 (its n_positions and
max_trained_positions both 2048), adds expert_count, expert_used_count (moe_top_k) and
moe_every_n_layers, and keeps fc1 as ffn_up, the router as ffn_gate_inp, w1 as ffn_up_exps
[experts, width, hidden] and w2 turned to ffn_down_exps [experts, hidden, width]; it drops
mlp.experts.bias (NomicExperts' one bias after the sum), so llama.cpp adds none, nor does
llmrun from such a file. llama.cpp computes gelu(up(x)) where the layer has no experts,
else softmax over all experts, the top expert_used_count weighing their down(gelu(up(x)))
unnormalized (build_moe_ffn with norm_w false and no scale). Its CPU GELU reads an f16
table of the tanh approximation; llmrun computes the model's exact GELU.
A converter run where transformers 5 is installed reads config.json through transformers'
own NomicBertConfig (v1.5's fields and defaults), and writes v2-moe with rope.freq_base
1000, layer_norm_epsilon 1e-12 and context 2046 instead of 10000, 1e-5 and 512; llmrun,
as llama.cpp, runs such a file as it says.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import bert

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = "nomic-bert"
MOE_ARCH = "nomic-bert-moe"
ARCHS = (ARCH, MOE_ARCH)
MODEL_TYPE = "nomic_bert"
ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train where the file gives none
FUSED_QKV = ("self_attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
hf_name = bert.name_table(
    {
        MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
        MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
        MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
        MODEL_TENSOR.ATTN_QKV: FUSED_QKV[0],
        MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
        MODEL_TENSOR.ATTN_OUT_NORM: "post_attention_layernorm",
        MODEL_TENSOR.FFN_UP: "mlp.up_proj",
        MODEL_TENSOR.FFN_GATE: "mlp.gate_proj",
        MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
        MODEL_TENSOR.LAYER_OUT_NORM: "post_mlp_layernorm",
        MODEL_TENSOR.FFN_GATE_INP: "mlp.router",
        MODEL_TENSOR.FFN_UP_EXP: "mlp.experts.{expert}.up_proj",  # split by the loader
        MODEL_TENSOR.FFN_DOWN_EXP: "mlp.experts.{expert}.down_proj",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "embeddings.word_embeddings",
        MODEL_TENSOR.TOKEN_TYPES: "embeddings.token_type_embeddings",
        MODEL_TENSOR.TOKEN_EMBD_NORM: "embeddings.LayerNorm",
    },
    "layers",
)
# A "nomic-bert-moe" GGUF's expert counts -> the config's fields.
_MOE_KEYS = {Keys.LLM.EXPERT_COUNT: "num_experts", Keys.LLM.EXPERT_USED_COUNT: "moe_top_k"}
# The Hub's config fields -> transformers 5's.
_HUB_FIELDS = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_inner": "intermediate_size",
    "layer_norm_epsilon": "layer_norm_eps",
    "rotary_emb_base": "rope_theta",
}
# The Hub's settings llmrun's model (and llama.cpp's converter) computes only one way:
# field -> (the value it takes, what another value would be).
_HUB_FIXED = {
    "prenorm": (False, "pre-norm blocks"),
    "causal": (False, "causal attention"),
    "rotary_emb_fraction": (1.0, "RoPE on part of each head"),
    "rotary_emb_interleaved": (False, "interleaved RoPE"),
    "rotary_emb_scale_base": (None, "xPos RoPE scaling"),
    "rotary_scaling_factor": (None, "dynamic NTK RoPE scaling"),
    "use_rms_norm": (False, "RMSNorm"),
    "parallel_block": (False, "parallel attention and feed-forward"),
    "moe_normalize_expert_weights": (False, "renormalized expert weights"),
    "num_shared_experts": (0, "shared experts"),
    "expert_choice_router": (False, "expert-choice routing"),
    "ffn_div": (1, "experts narrower than n_inner"),
}
# The Hub's feed-forward activations -> (hidden_act, whether gated).
_HUB_ACTIVATIONS = {"swiglu": ("silu", True), "gelu": ("gelu", False)}
# The Hub's module names -> transformers 5's (its conversion_mapping for nomic_bert).
_HUB_NAMES = (
    ("emb_ln.", "embeddings.LayerNorm."),
    ("encoder.layers.", "layers."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".mlp.fc11.", ".mlp.up_proj."),
    (".mlp.fc12.", ".mlp.gate_proj."),
    (".mlp.fc1.", ".mlp.up_proj."),
    (".mlp.fc2.", ".mlp.down_proj."),
    (".norm1.", ".post_attention_layernorm."),
    (".norm2.", ".post_mlp_layernorm."),
    (".mlp.router.layer.", ".mlp.router."),
    (".mlp.experts.bias", ".mlp.bias"),
)
_HUB_QKV = ".attn.Wqkv."
# NomicExpertMLP's stacks, both [experts * width, hidden]: w1 the up rows, w2 each expert's
# down projection transposed.
_HUB_EXPERTS = (".mlp.experts.mlp.w1", ".mlp.experts.mlp.w2")


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style nomic_bert config from a "nomic-bert" or "nomic-bert-moe" GGUF, as
    llama.cpp reads it: biases where layer 0 has them (llama.cpp's are each optional); for
    "nomic-bert-moe", GELU feed-forwards and the experts' counts. RoPE scaling, which
    llama.cpp's graph would apply and the models never have, is refused."""
    arch = gg.architecture
    scaling = gg.metadata.get(Keys.Rope.SCALING_TYPE.format(arch=arch), "none")
    if scaling not in ("none", None):
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.SCALING_TYPE.format(arch=arch)} is {scaling!r}; "
            "nomic-bert models have unscaled RoPE"
        )
    theta = gg.metadata.get(Keys.Rope.FREQ_BASE.format(arch=arch), ROPE_BASE)

    def has(kind: MODEL_TENSOR, suffix: str = "bias") -> bool:
        return f"{TENSOR_NAMES[kind].format(bid=0)}.{suffix}" in gg.tensors

    config = {
        "model_type": MODEL_TYPE,
        **bert.encoder_config(gg),
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": has(MODEL_TENSOR.ATTN_QKV) or has(MODEL_TENSOR.ATTN_Q),
        "mlp_bias": has(MODEL_TENSOR.FFN_UP),
    }
    if arch != MOE_ARCH:
        return config
    every = gg.metadata.get(Keys.LLM.MOE_EVERY_N_LAYERS.format(arch=arch), 0)
    config.update(hidden_act="gelu", gated_mlp=False, moe_every_n_layers=every)
    if every:
        for key, field in _MOE_KEYS.items():
            name = key.format(arch=arch)
            if not gg.metadata.get(name):
                raise ModelFormatError(
                    f"{gg.path}: metadata {name!r} is missing or 0 (a {arch} file with "
                    f"moe_every_n_layers {every} needs it)"
                )
            config[field] = gg.metadata[name]
    return config


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The file's weights as the model takes them (bert.gguf_weights: attn_qkv split), each
    layer of experts with a zero bias after their sum (the converter drops the Hub's)."""
    import torch

    out = bert.gguf_weights(weights, config, weight_type, *FUSED_QKV)
    for name in [n for n in out if n.endswith(".mlp.router.weight")]:
        bias = name.removesuffix("router.weight") + "bias"
        out.setdefault(bias, weight_type(torch.zeros(config["hidden_size"])))
    return out


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], folder: Path, weight_type: type
) -> tuple[dict[str, Any], dict]:
    """A folder's config and weights as transformers 5 reads them: the Hub's config fields
    (nomic-ai's NomicBertConfig: n_embd, ...) renamed, and the Hub's module names, which
    transformers 5 also writes (its conversion mapping, reversed on saving)."""
    if "n_embd" in config:
        config = hub_config(config, folder / "config.json")
    return config, hub_weights(weights, config, weight_type)


def hub_config(config: dict[str, Any], where: Any) -> dict[str, Any]:
    """The Hub's config as transformers 5's NomicBertConfig: fields renamed, the context
    the trained one (max_trained_positions), SwiGLU as silu (GELU as a plain feed-forward),
    the biases as attention_bias and mlp_bias, v2-moe's experts (moe_every_n_layers,
    num_experts, moe_top_k) as they are; a setting the model does not compute is refused
    by name."""
    for name, (value, what) in _HUB_FIXED.items():
        if config.get(name, value) != value:
            raise UnsupportedError(
                f"{where}: {name} is {config[name]!r}: {what} is not supported in nomic_bert models"
            )
    function = config.get("activation_function", "swiglu")
    if function not in _HUB_ACTIVATIONS:
        raise UnsupportedError(
            f"{where}: activation_function {function!r} is not supported in nomic_bert models "
            f"(supported: {', '.join(_HUB_ACTIVATIONS)})"
        )
    fc1, fc2 = config.get("mlp_fc1_bias", False), config.get("mlp_fc2_bias", False)
    if fc1 != fc2:
        raise UnsupportedError(
            f"{where}: mlp_fc1_bias is {fc1!r} but mlp_fc2_bias {fc2!r}: a feed-forward with "
            "a bias on one projection only is not supported in nomic_bert models"
        )
    out = {k: v for k, v in config.items() if k not in _HUB_FIELDS}
    out.update({new: config[old] for old, new in _HUB_FIELDS.items() if old in config})
    out["hidden_act"], out["gated_mlp"] = _HUB_ACTIVATIONS[function]
    out["attention_bias"], out["mlp_bias"] = bool(config.get("qkv_proj_bias", False)), bool(fc1)
    out["max_position_embeddings"] = config.get("max_trained_positions") or config.get(
        "n_positions"
    )
    return out


def hub_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The Hub's tensors under transformers 5's names: Wqkv's rows (weight and bias) split
    into the queries, keys and values (views of them); the experts' stacks w1 and w2 split
    into each expert's up_proj (a view) and down_proj (w2's rows transposed, a copy)."""
    hidden = config["hidden_size"]
    out = {}
    for name, w in weights.items():
        for old, new in _HUB_NAMES:
            name = name.replace(old, new) if old in name else name
        if name.endswith(_HUB_EXPERTS):
            out.update(_hub_experts(name, w, config, weight_type))
            continue
        if _HUB_QKV not in name:
            out[name] = w
            continue
        if w.shape[0] != 3 * hidden:
            raise ModelFormatError(
                f"{name} has {w.shape[0]} rows, but the config implies {3 * hidden}"
            )
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            split = name.replace(_HUB_QKV, f".self_attn.{part}.")
            out[split] = weight_type(w.tensor[i * hidden : (i + 1) * hidden])
    return out


def _hub_experts(name: str, w: Any, config: dict[str, Any], weight_type: type) -> dict:
    """One of NomicExpertMLP's stacks [experts * width, hidden] as each expert's matrix:
    w1's rows are expert e's up_proj, w2's its down_proj transposed."""
    hidden, width = config["hidden_size"], config["intermediate_size"]
    count = config.get("num_experts") or 0
    if tuple(w.shape) != (count * width, hidden):
        raise ModelFormatError(
            f"{name} has shape {list(w.shape)}, but the config implies "
            f"[{count * width}, {hidden}] ({count} experts of width {width}, hidden {hidden})"
        )
    # [E * width, hidden] -> [E, width, hidden]
    stack = w.tensor.view(count, width, hidden)
    prefix = name.rsplit(".mlp.", 2)[0] + ".mlp.experts"
    if name.endswith(_HUB_EXPERTS[0]):
        return {f"{prefix}.{e}.up_proj.weight": weight_type(stack[e]) for e in range(count)}
    return {
        f"{prefix}.{e}.down_proj.weight": weight_type(stack[e].t().contiguous())
        for e in range(count)
    }
