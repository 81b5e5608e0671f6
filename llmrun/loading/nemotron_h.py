"""Nemotron-H at the loader edge: "nemotron_h" and "nemotron_h_moe" GGUFs as llama.cpp's
converter writes them (conversion/nemotron.py NemotronHModel, over granite.py's
GraniteHybridModel and mamba.py's Mamba2Model) and llama.cpp reads them
(src/models/nemotron-h.cpp, its load_arch_hparams and graph), and the Hub's checkpoints
under transformers' names (llmrun/models/nemotron_h.py).

The layer kinds are not written as such: feed_forward_length and head_count_kv are
per-layer arrays, and llama.cpp takes a layer with neither to be Mamba-2, one with KV
heads and no feed-forward to be attention, one with a feed-forward to be an MLP, or
experts where the file has any. The converter permutes the attention's q/k rows as
Llama's (undone, though without RoPE they attend alike), stores Mamba-2's A, D, the
convolution and the gated norm as Granite 4.0-H's converter does
(granitehybrid.mamba2_weight undoes it), dt_bias as ssm_dt.bias, the experts stacked, the
router's correction bias as exp_probs_b.bias, and a multi-token-prediction block after
the trunk's layers (nextn_predict_layers; skipped, as llama.cpp's inference skips it).
llama.cpp's defaults where a key is absent: the RMS norm's epsilon is
attention.layer_norm_epsilon, experts are not renormalized nor scaled, routed in one
group, as wide as feed_forward_length / expert_used_count; the gating is the sigmoid
whatever a file says; attention scores are scaled by head_dim^-0.5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading import glm4_moe, granitehybrid
from llmrun.loading.gguf_io import ArchMetadata, layer_name

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

MODEL_TYPE = "nemotron_h"
ARCHS = ("nemotron_h", "nemotron_h_moe")
MODEL_TYPES = dict.fromkeys(ARCHS, MODEL_TYPE)


# GGUF tensor (after "blk.N.", without its suffix) -> HF module (after "model.layers.N.").
LAYER_NAMES = {
    layer_name(MODEL_TENSOR.ATTN_NORM): "norm",
    layer_name(MODEL_TENSOR.ATTN_Q): "mixer.q_proj",
    layer_name(MODEL_TENSOR.ATTN_K): "mixer.k_proj",
    layer_name(MODEL_TENSOR.ATTN_V): "mixer.v_proj",
    layer_name(MODEL_TENSOR.ATTN_OUT): "mixer.o_proj",
    layer_name(MODEL_TENSOR.SSM_IN): "mixer.in_proj",
    layer_name(MODEL_TENSOR.SSM_CONV1D): "mixer.conv1d",
    layer_name(MODEL_TENSOR.SSM_NORM): "mixer.norm",
    layer_name(MODEL_TENSOR.SSM_OUT): "mixer.out_proj",
    layer_name(MODEL_TENSOR.FFN_UP): "mixer.up_proj",
    layer_name(MODEL_TENSOR.FFN_DOWN): "mixer.down_proj",
    layer_name(MODEL_TENSOR.FFN_GATE_INP): "mixer.gate",
    layer_name(MODEL_TENSOR.FFN_UP_SHEXP): "mixer.shared_experts.up_proj",
    layer_name(MODEL_TENSOR.FFN_DOWN_SHEXP): "mixer.shared_experts.down_proj",
    layer_name(MODEL_TENSOR.MOE_LATENT_DOWN): "mixer.fc1_latent_proj",
    layer_name(MODEL_TENSOR.MOE_LATENT_UP): "mixer.fc2_latent_proj",
    # Each expert's module, with an {expert} field: the loader splits the stacks.
    layer_name(MODEL_TENSOR.FFN_UP_EXP): "mixer.experts.{expert}.up_proj",
    layer_name(MODEL_TENSOR.FFN_DOWN_EXP): "mixer.experts.{expert}.down_proj",
}
# Whole names (after "blk.N.") of the tensors that are a parameter, not a module's.
LAYER_PARAMETERS = {
    f"{layer_name(MODEL_TENSOR.SSM_DT)}.bias": "mixer.dt_bias",
    layer_name(MODEL_TENSOR.SSM_A): "mixer.A_log",  # A and D have no suffix in llama.cpp's files
    layer_name(MODEL_TENSOR.SSM_D): "mixer.D",
    f"{layer_name(MODEL_TENSOR.FFN_EXP_PROBS_B)}.bias": "mixer.gate.e_score_correction_bias",
}
GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embeddings",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.norm_f",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face key of a Nemotron-H GGUF tensor, or None if it has none."""
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, rest = parts[1], parts[2]
        if rest in LAYER_PARAMETERS:
            return f"model.layers.{layer}.{LAYER_PARAMETERS[rest]}"
        module, _, suffix = rest.rpartition(".")
        if module in LAYER_NAMES and suffix in ("weight", "bias"):
            return f"model.layers.{layer}.{LAYER_NAMES[module]}.{suffix}"
        return None
    module, _, suffix = gguf_name.rpartition(".")
    if module in GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{GLOBAL_NAMES[module]}.{suffix}"
    return None


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The HF config.json dict of a nemotron_h or nemotron_h_moe GGUF, read as
    llama_model_nemotron_h::load_arch_hparams and the common load_hparams read it."""
    arch = gg.architecture
    meta = ArchMetadata.of(gg)
    layers, nextn = glm4_moe.trunk_layers(gg, arch)
    blocks = layers + nextn

    def per_layer(template: str) -> list[int]:
        """A key llama.cpp reads per layer (an array) or for all (a number): the trunk's."""
        value = meta.require(template)
        if not isinstance(value, list):
            return [value] * layers
        if len(value) != blocks:
            raise ModelFormatError(
                f"{gg.path}: {template.format(arch=arch)} lists {len(value)} layers, but "
                f"block_count is {blocks}"
            )
        return value[:layers]

    def one(name: str, values: list[Any]) -> Any:
        """The one value of a per-layer key over the layers that use it (None: none do)."""
        distinct = set(values)
        if len(distinct) > 1:
            raise ModelFormatError(
                f"{gg.path}: {arch}.{name} differs between layers ({sorted(distinct)}), "
                "which llmrun does not support"
            )
        return distinct.pop() if distinct else None

    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    kv_heads = per_layer(Keys.Attention.HEAD_COUNT_KV)
    heads = per_layer(Keys.Attention.HEAD_COUNT)
    widths = per_layer(Keys.LLM.FEED_FORWARD_LENGTH)
    experts = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    kinds = [
        ("moe" if experts else "mlp") if ff else ("attention" if kv else "mamba")
        for kv, ff in zip(kv_heads, widths, strict=True)
    ]
    attending = [i for i, kind in enumerate(kinds) if kind == "attention"]
    n_heads = one("attention.head_count", [heads[i] for i in attending]) or 1
    n_kv = one("attention.head_count_kv", [kv_heads[i] for i in attending]) or 1
    inner = meta.require(Keys.SSM.INNER_SIZE)
    ssm_heads = meta.require(Keys.SSM.TIME_STEP_RANK)
    if not ssm_heads or inner % ssm_heads:
        raise ModelFormatError(
            f"{gg.path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
            f"{ssm_heads} (the Mamba-2 heads)"
        )
    eps = meta.require(Keys.Attention.LAYERNORM_EPS)
    ff = one("feed_forward_length", [w for w in widths if w])  # the MLP or MoE layers
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "layers_block_type": kinds,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads,
        "layer_norm_epsilon": meta.get(Keys.Attention.LAYERNORM_RMS_EPS, eps),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "vocab_size": _vocab_size(gg, meta),
        "tie_word_embeddings": f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight" not in gg.tensors,
        "attention_bias": bool(attending) and f"blk.{attending[0]}.attn_q.bias" in gg.tensors,
        "intermediate_size": ff or 1,
        "mlp_bias": any(n.endswith(".ffn_up.bias") for n in gg.tensors),
        "mamba_num_heads": ssm_heads,
        "mamba_head_dim": inner // ssm_heads,
        "n_groups": meta.require(Keys.SSM.GROUP_COUNT),
        "ssm_state_size": meta.require(Keys.SSM.STATE_SIZE),
        "conv_kernel": meta.require(Keys.SSM.CONV_KERNEL),
        "use_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in gg.tensors),
        "use_bias": False,  # llama.cpp reads no bias of in_proj or out_proj
        glm4_moe.NEXTN: nextn,
    }
    if experts:
        config.update(_experts(gg, meta, one, kinds, widths, experts))
    return config


def _experts(
    gg: GGUFFile, meta: ArchMetadata, one: Callable, kinds: list[str], widths: list[int], count: int
) -> dict[str, Any]:
    """The experts' config fields, as llama.cpp reads and routes them (build_moe_ffn with
    sigmoid gating and the exp_probs_b correction)."""
    moe = [i for i, kind in enumerate(kinds) if kind == "moe"]
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    used = one("expert_used_count", [used[i] for i in moe] if isinstance(used, list) else [used])
    if not used or not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=gg.architecture)} is {used}, "
            f"but {Keys.LLM.EXPERT_COUNT.format(arch=gg.architecture)} is {count}"
        )
    width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):
        width = one("expert_feed_forward_length", [width[i] for i in moe])
    if not width:
        width = one("feed_forward_length", [widths[i] // used for i in moe])
    shared = meta.require(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
    groups = meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0) or 1
    chosen_groups = meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0) if groups > 1 else 1
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)
    return {
        "n_routed_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width,
        "moe_shared_expert_intermediate_size": shared,
        "moe_latent_size": meta.get(Keys.LLM.MOE_LATENT_SIZE) or None,
        "norm_topk_prob": bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        "routed_scaling_factor": scale or 1.0,  # llama.cpp scales where it is not 0 (or 1)
        "n_group": groups,
        "topk_group": chosen_groups,
    }


def _vocab_size(gg: GGUFFile, meta: ArchMetadata) -> int | None:
    embed = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    return (
        meta.get(Keys.LLM.VOCAB_SIZE)
        or (embed.shape[0] if embed else None)
        or (len(tokens) if tokens else None)
    )


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A Nemotron-H GGUF's tensors as the model holds them: q/k rows unpermuted, the
    Mamba-2 tensors in their HF shapes (granitehybrid.mamba2_weight). `weight_type`
    wraps a tensor (loader.Weight)."""
    from llmrun.loading.gguf_io import unpermute_rows

    heads = {
        "mixer.q_proj.weight": config["num_attention_heads"],
        "mixer.q_proj.bias": config["num_attention_heads"],
        "mixer.k_proj.weight": config["num_key_value_heads"],
        "mixer.k_proj.bias": config["num_key_value_heads"],
    }
    kinds = config["layers_block_type"]
    out = {}
    for name, w in weights.items():
        if not name.startswith("model.layers."):
            out[name] = w
            continue
        _, _, layer, part = name.split(".", 3)  # model.layers.N.<part>
        if part in heads:
            out[name] = weight_type(unpermute_rows(w.tensor, heads[part]), w.ggml_type, w.shape)
        elif kinds[int(layer)] == "mamba" and part.startswith("mixer."):
            out[name] = granitehybrid.mamba2_weight(
                name, part.removeprefix("mixer."), w, weight_type
            )
        else:
            out[name] = w
    return out


def hf_weights(weights: dict[str, Any], weight_type: type) -> dict:
    """A Hub checkpoint's tensors under transformers' names: backbone. as model., the
    multi-token-prediction head (mtp.*, which transformers does not run) left out, and a
    stack of experts (transformers 5's experts.up_proj [E, out, in]) split into one
    module's weight per expert."""
    out = {}
    for name, w in weights.items():
        if name.startswith("mtp."):
            continue
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        prefix, _, projection = name.rpartition(".")
        if prefix.endswith(".mixer.experts") and projection in ("up_proj", "down_proj"):
            for e in range(w.tensor.shape[0]):
                out[f"{prefix}.{e}.{projection}.weight"] = weight_type(w.tensor[e])
            continue
        out[name] = w
    return out


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a nemotron_h config.json-style dict cache keys and values (its
    attention layers), None for other models (llmrun.loading.inspect)."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if kinds is None:
        kinds = config.get("hybrid_override_pattern")
    if kinds is None:
        return 1  # transformers' default pattern: one attention layer of four
    return sum(1 for kind in kinds if kind in ("attention", "full_attention", "*"))
