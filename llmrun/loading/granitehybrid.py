"""Granite 4.0-H at the loader edge: "granitehybrid" GGUFs as llama.cpp's converter writes
them (conversion/granite.py GraniteHybridModel, with mamba.py Mamba2Model's tensors) and
llama.cpp reads them (src/models/granite-hybrid.cpp, mamba-base.cpp), and the Hub's
granitemoehybrid checkpoints' feed-forward under llmrun's names
(llmrun/models/granitemoehybrid.py).

What the converter does, undone here: head_count_kv is written per layer, 0 for a
Mamba-2 layer (llama.cpp's is_recr); the attention's q/k rows are permuted as Llama's
(undo_permute); A_log is stored as A = -exp(A_log) [heads, 1], D as [heads, 1], the
convolution [channels, 1, d_conv] as [channels, d_conv], the gated norm's weight as
[n_groups, inner / n_groups], dt_bias as ssm_dt.bias; the experts' fused gate/up rows are
split into stacks, the shared expert is ffn_*_shexp (ffn_gate/up/down without experts).
RoPE is on only where rope.scaling.finetuned says so (llama.cpp's switch for Granite,
default true; the converter writes false for the released hybrids, which have none).
llama.cpp's defaults where a key is absent: no logit, embedding or residual scale, an
attention scale of head_dim^-0.5. Granite models without Mamba-2 layers are converted as
"granite" or "granitemoe" (llmrun/loading/granite.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading import granite
from llmrun.loading.gguf_io import ArchMetadata, layer_name

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH, MODEL_TYPE = "granitehybrid", "granitemoehybrid"


# GGUF tensor (after "blk.N.", with its suffix) -> HF key (after "model.layers.N."): the
# Mamba-2 mixer's (A and D have no suffix in llama.cpp's files) and the experts'; the
# loader splits the stacks ({expert}). Attention, norms and a dense feed-forward have
# Llama's names (gguf_config.hf_name).
LAYER_NAMES = {
    f"{layer_name(MODEL_TENSOR.SSM_IN)}.weight": "mamba.in_proj.weight",
    f"{layer_name(MODEL_TENSOR.SSM_CONV1D)}.weight": "mamba.conv1d.weight",
    f"{layer_name(MODEL_TENSOR.SSM_CONV1D)}.bias": "mamba.conv1d.bias",
    f"{layer_name(MODEL_TENSOR.SSM_DT)}.bias": "mamba.dt_bias",
    layer_name(MODEL_TENSOR.SSM_A): "mamba.A_log",
    layer_name(MODEL_TENSOR.SSM_D): "mamba.D",
    f"{layer_name(MODEL_TENSOR.SSM_NORM)}.weight": "mamba.norm.weight",
    f"{layer_name(MODEL_TENSOR.SSM_OUT)}.weight": "mamba.out_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_GATE_INP)}.weight": "mlp.gate.weight",
    f"{layer_name(MODEL_TENSOR.FFN_GATE_EXP)}.weight": "mlp.experts.{expert}.gate_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_UP_EXP)}.weight": "mlp.experts.{expert}.up_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_DOWN_EXP)}.weight": "mlp.experts.{expert}.down_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_GATE_SHEXP)}.weight": "mlp.shared_expert.gate_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_UP_SHEXP)}.weight": "mlp.shared_expert.up_proj.weight",
    f"{layer_name(MODEL_TENSOR.FFN_DOWN_SHEXP)}.weight": "mlp.shared_expert.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face key of a granitehybrid layer's Mamba-2 or expert tensor, or None
    (Llama's names apply)."""
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    name = LAYER_NAMES.get(parts[2])
    return None if name is None else f"model.layers.{parts[1]}.{name}"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable) -> dict[str, Any]:
    """The HF config.json dict of a granitehybrid GGUF. rope_from_gguf:
    gguf_config._rope_from_gguf."""
    arch = gg.architecture
    meta = ArchMetadata.of(gg)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    kv_heads = _per_layer(gg, Keys.Attention.HEAD_COUNT_KV, meta, layers)
    heads = _per_layer(gg, Keys.Attention.HEAD_COUNT, meta, layers)
    # llama.cpp: a layer is recurrent where its KV head count is 0.
    kinds = ["attention" if n else "mamba" for n in kv_heads]
    attending = [i for i, kind in enumerate(kinds) if kind == "attention"]
    n_heads = _one(gg, "attention.head_count", [heads[i] for i in attending]) or 1
    n_kv = _one(gg, "attention.head_count_kv", [kv_heads[i] for i in attending]) or 1
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    inner = meta.require(Keys.SSM.INNER_SIZE)
    ssm_heads = meta.require(Keys.SSM.TIME_STEP_RANK)
    if inner % hidden or inner % ssm_heads:
        raise ModelFormatError(
            f"{gg.path}: ssm.inner_size {inner} is not a multiple of the embedding length "
            f"{hidden} and of ssm.time_step_rank {ssm_heads} (the Mamba-2 heads)"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    ff = _one(gg, "feed_forward_length", _as_list(meta.require(Keys.LLM.FEED_FORWARD_LENGTH)))
    experts = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": _vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": bool(attending) and f"blk.{attending[0]}.attn_q.bias" in gg.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in gg.tensors,
        "layer_types": kinds,
        "logits_scaling": meta.get(Keys.LLM.LOGIT_SCALE) or 1.0,
        "embedding_multiplier": meta.get(Keys.LLM.EMBEDDING_SCALE) or 1.0,
        "residual_multiplier": meta.get(Keys.LLM.RESIDUAL_SCALE) or 1.0,
        "attention_multiplier": meta.get(Keys.Attention.SCALE) or head_dim**-0.5,
        "mamba_expand": inner // hidden,
        "mamba_n_heads": ssm_heads,
        "mamba_d_head": inner // ssm_heads,
        "mamba_n_groups": meta.require(Keys.SSM.GROUP_COUNT),
        "mamba_d_state": meta.require(Keys.SSM.STATE_SIZE),
        "mamba_d_conv": meta.require(Keys.SSM.CONV_KERNEL),
        "mamba_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in gg.tensors),
        "mamba_proj_bias": False,  # llama.cpp reads no bias of in_proj or out_proj
    }
    if experts:
        used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
        if not 0 < used <= experts:
            raise ModelFormatError(
                f"{gg.path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)} is {used}, but "
                f"{Keys.LLM.EXPERT_COUNT.format(arch=arch)} is {experts}"
            )
        # llama.cpp's granite-hybrid graph: softmax over the router, the top-k renormalized,
        # unscaled; a shared expert where its width is given.
        config.update(
            num_local_experts=experts,
            num_experts_per_tok=used,
            shared_intermediate_size=meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
        )
    else:
        # Without experts the feed-forward is the dense ffn_gate/up/down, n_ff wide.
        config.update(num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=ff)
    if meta.get(Keys.Rope.SCALING_FINETUNED, True):
        config["position_embedding_type"] = "rope"
        config["rope_parameters"] = rope_from_gguf(gg, meta, head_dim, context)
    else:
        config["position_embedding_type"] = "nope"
    return config


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _per_layer(gg: GGUFFile, template: str, meta: ArchMetadata, layers: int) -> list[int]:
    """A key llama.cpp reads per layer (an array) or for all layers (a number)."""
    value = meta.require(template)
    if not isinstance(value, list):
        return [value] * layers
    if len(value) != layers:
        raise ModelFormatError(
            f"{gg.path}: {template.format(arch=gg.architecture)} lists {len(value)} layers, "
            f"but block_count is {layers}"
        )
    return value


def _one(gg: GGUFFile, name: str, values: list[int]) -> int | None:
    """The one value of a per-layer key over the layers that have it (None: no layer)."""
    distinct = set(values)
    if len(distinct) > 1:
        raise ModelFormatError(
            f"{gg.path}: {gg.architecture}.{name} differs between layers ({sorted(distinct)}), "
            "which llmrun does not support"
        )
    return distinct.pop() if distinct else None


def _vocab_size(gg: GGUFFile, meta: ArchMetadata) -> int | None:
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get("token_embd.weight")
    return (
        meta.get(Keys.LLM.VOCAB_SIZE)
        or (embed.shape[0] if embed else None)
        or (len(tokens) if tokens else None)
    )


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A granitehybrid GGUF's tensors as the model holds them: q/k rows unpermuted, A_log
    from A, D, the convolution and the gated norm in their HF shapes. `weight_type`
    wraps a tensor (loader.Weight)."""
    from llmrun.loading.gguf_io import unpermute_rows

    heads = {
        "self_attn.q_proj.weight": config["num_attention_heads"],
        "self_attn.q_proj.bias": config["num_attention_heads"],
        "self_attn.k_proj.weight": config["num_key_value_heads"],
        "self_attn.k_proj.bias": config["num_key_value_heads"],
    }
    out = {}
    for name, w in weights.items():
        part = name.split(".", 3)[-1]  # after "model.layers.N."
        if part in heads:
            out[name] = weight_type(unpermute_rows(w.tensor, heads[part]), w.ggml_type, w.shape)
            continue
        if part.startswith("mamba."):
            out[name] = mamba2_weight(name, part.removeprefix("mamba."), w, weight_type)
        else:
            out[name] = w
    return out


def mamba2_weight(name: str, part: str, w: Any, weight_type: type) -> Any:
    """A Mamba-2 mixer's tensor `name` (`part`: its name in the mixer, e.g. "A_log") of a
    GGUF as the model holds it: A_log from A = -exp(A_log) [heads, 1], the convolution
    [channels, 1, d_conv] from [channels, d_conv], D and the gated norm's weight flat;
    in_proj and out_proj as they are (llama.cpp's Mamba2Model.modify_tensors, undone)."""
    if part in ("in_proj.weight", "out_proj.weight"):
        return w
    if w.ggml_type is not None:
        raise ModelFormatError(
            f"tensor {name} is quantized ({w.ggml_type.name}); llama.cpp keeps the Mamba-2 "
            "convolution, A, D, dt bias and norm in float"
        )
    tensor = w.tensor
    if part == "A_log":
        if (tensor >= 0).any():
            raise ModelFormatError(f"tensor {name}: A = -exp(A_log) must be negative")
        tensor = (-tensor.float()).log().reshape(-1)
    elif part == "conv1d.weight":
        tensor = tensor.reshape(tensor.shape[0], 1, -1)  # [C, K] -> [C, 1, K]
    else:
        tensor = tensor.reshape(-1)  # D [H, 1], norm [G, inner / G]
    return weight_type(tensor)


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A granitemoehybrid checkpoint's feed-forward under llmrun's names: as granitemoe's
    (granite.hf_weights: the router, the experts and the shared expert split from their
    fused tensors); without experts, the shared expert is the layer's dense MLP."""
    out = granite.hf_weights(weights, config, weight_type)
    if config.get("num_local_experts", 8):
        return out
    return {name.replace(".mlp.shared_expert.", ".mlp."): w for name, w in out.items()}


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a granitemoehybrid config.json-style dict cache keys and values
    (its attention layers), None for other models (llmrun.loading.inspect)."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layer_types") or config.get("layers_block_type")
    if kinds is None:
        return 0  # transformers' default: every layer Mamba-2
    return sum(1 for kind in kinds if kind in ("attention", "full_attention"))
