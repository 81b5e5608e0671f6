"""DeepSeek V2/V3 at the loader edge: a GGUF of llama.cpp's arch "deepseek2" as
llama.cpp's converter writes it (conversion/deepseek.py) and llama.cpp reads it
(src/models/deepseek2.cpp, llama-context.cpp's YaRN factors, llama-graph.cpp's
build_moe_ffn), as the config and tensors of llmrun's deepseek_v2 (softmax gating) or
deepseek_v3 (sigmoid gating) model, or youtu (Youtu-LLM: every block dense, no experts).

Two forms of the key/value expansion exist. Older files hold HF's kv_b_proj as
attn_kv_b. Newer ones (those with attention.key_length_mla) hold it split per head for
llama.cpp's absorbed MLA: attn_k_b [heads, kv_lora_rank, qk_nope] (each head's key rows
transposed) and attn_v_b [heads, v_head_dim, kv_lora_rank]; they are joined back into
kv_b_proj, in floats (dequantized where the file has blocks); so is attn_kv_b in blocks,
since the model reads its rows (deepseek_v2's absorbed attention). The converter writes the
YaRN log multiplier as 0.1 * mscale_all_dim, and llama.cpp takes the config's mscale to
be mscale_all_dim. GLM-4.7-Flash's files (conversion/glm.py Glm4MoeLiteModel) end with
nextn_predict_layers multi-token-prediction layers, counted in block_count; llmrun skips
them, as llama.cpp's inference does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata
from llmrun.loading.glm4_moe import NEXTN, trunk_layers

if TYPE_CHECKING:
    import torch

ARCH = "deepseek2"
# Youtu-LLM: DeepSeek-V3's attention, every layer dense (a deepseek2 file without experts).
YOUTU = "youtu"
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", YOUTU)
# Sarvam MLA's folders (sarvam-105b): DeepSeek-V3's keys; llama.cpp has no converter for it.
SARVAM_MLA = "sarvam_mla"
# Mistral 4's GGUF arch and model_type: DeepSeek-V3's layers with a softmax router.
MISTRAL4 = "mistral4"
ARCHS = (ARCH, MISTRAL4)
# llama.cpp's default gating where a file has no expert_gating_func (load_arch_hparams):
# softmax (DeepSeek V2/V2.5 files predate the key), but sigmoid for GLM-4.7-Flash,
# told apart by its layer counts and vocabulary.
SIGMOID_DEFAULT = ((47, 48), 154880)
# The converter's factor on the YaRN log multiplier ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]).
YARN_LOG_MUL_FACTOR = 0.1
# llmrun.models.deepseek_v2.TEMPERATURE_LENGTH: the rope_parameters key for the length.
TEMPERATURE_LENGTH = "llama_4_scaling_length"


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF tensor (after blk.N., without .weight) -> llmrun's module in the layer.
_LAYER_NAMES = {
    _short(t): name
    for t, name in [
        (MODEL_TENSOR.ATTN_NORM, "input_layernorm"),
        (MODEL_TENSOR.FFN_NORM, "post_attention_layernorm"),
        (MODEL_TENSOR.ATTN_Q, "self_attn.q_proj"),
        (MODEL_TENSOR.ATTN_Q_A, "self_attn.q_a_proj"),
        (MODEL_TENSOR.ATTN_Q_A_NORM, "self_attn.q_a_layernorm"),
        (MODEL_TENSOR.ATTN_Q_B, "self_attn.q_b_proj"),
        (MODEL_TENSOR.ATTN_KV_A_MQA, "self_attn.kv_a_proj_with_mqa"),
        (MODEL_TENSOR.ATTN_KV_A_NORM, "self_attn.kv_a_layernorm"),
        (MODEL_TENSOR.ATTN_KV_B, "self_attn.kv_b_proj"),
        (MODEL_TENSOR.ATTN_K_B, "self_attn.k_b_proj"),  # joined into kv_b_proj
        (MODEL_TENSOR.ATTN_V_B, "self_attn.v_b_proj"),  # joined into kv_b_proj
        (MODEL_TENSOR.ATTN_OUT, "self_attn.o_proj"),
        (MODEL_TENSOR.FFN_GATE, "mlp.gate_proj"),
        (MODEL_TENSOR.FFN_UP, "mlp.up_proj"),
        (MODEL_TENSOR.FFN_DOWN, "mlp.down_proj"),
        (MODEL_TENSOR.FFN_GATE_INP, "mlp.gate"),
        (MODEL_TENSOR.FFN_GATE_SHEXP, "mlp.shared_experts.gate_proj"),
        (MODEL_TENSOR.FFN_UP_SHEXP, "mlp.shared_experts.up_proj"),
        (MODEL_TENSOR.FFN_DOWN_SHEXP, "mlp.shared_experts.down_proj"),
    ]
}
_GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.norm",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
}
EXPERT_STACKS = {
    _short(MODEL_TENSOR.FFN_GATE_EXP): "gate_proj",
    _short(MODEL_TENSOR.FFN_UP_EXP): "up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_EXP): "down_proj",
}
# DeepSeek-V3's e_score_correction_bias, which the converter names exp_probs_b.bias.
SELECTION_BIAS = _short(MODEL_TENSOR.FFN_EXP_PROBS_B)
K_B, V_B = "self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight"


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a deepseek2 GGUF tensor (a stack of experts: a
    template with an `{expert}` field; attn_k_b/attn_v_b: keys join_kv_b replaces), or
    None if the model has no such tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name = f"model.layers.{parts[1]}", parts[2]
    if name == SELECTION_BIAS and suffix == "bias":
        return f"{layer}.mlp.gate.e_score_correction_bias"
    if name in EXPERT_STACKS:
        return f"{layer}.mlp.experts.{{expert}}.{EXPERT_STACKS[name]}.{suffix}"
    if name in _LAYER_NAMES:
        return f"{layer}.{_LAYER_NAMES[name]}.{suffix}"
    return None


def config_from_gguf(gg, rope_from_gguf) -> dict[str, Any]:
    """An HF-style deepseek_v2/deepseek_v3 config from a deepseek2 GGUF's metadata (or
    mistral4 from a mistral4 one), read as llama.cpp reads it (the general keys and
    llama_model_deepseek2's load_arch_hparams, which mistral4's graph shares: which keys
    it requires, its defaults). `rope_from_gguf` is gguf_config's reader of the RoPE keys."""
    path, arch = gg.path, gg.architecture  # deepseek2 or mistral4
    meta = ArchMetadata.of(gg)
    meta.require(Keys.LLM.BLOCK_COUNT)  # named where missing; trunk_layers reads it
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    if not isinstance(heads, int) or heads <= 0:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Attention.HEAD_COUNT)} is {heads!r}; llmrun needs one number"
        )
    # GLM-4.7-Flash's files end with its MTP layer, which llama.cpp's inference skips.
    layers, nextn = trunk_layers(gg, arch)
    # Llama 4's query temperature (Mistral Large 3's files): llama.cpp counts its steps in
    # attention.temperature_length positions, which it requires with the scale.
    temperature = meta.get(Keys.Attention.TEMPERATURE_SCALE, 0.0)
    temperature_length = meta.get(Keys.Attention.TEMPERATURE_LENGTH, 0)
    if temperature and not temperature_length:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Attention.TEMPERATURE_SCALE)} without "
            f"{meta.name(Keys.Attention.TEMPERATURE_LENGTH)} (llama.cpp refuses it too)"
        )
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    vocab = meta.get(Keys.LLM.VOCAB_SIZE) or (len(tokens) if tokens else None)
    embed = gg.tensors.get("token_embd.weight")
    vocab = vocab or (embed.shape[0] if embed else None)
    rope_dim = meta.require(Keys.Rope.DIMENSION_COUNT)
    key_mla, value_mla = (
        meta.get(Keys.Attention.KEY_LENGTH_MLA, 0),
        meta.get(Keys.Attention.VALUE_LENGTH_MLA, 0),
    )
    if key_mla and value_mla:  # llama.cpp's is_mla(): attn_k_b and attn_v_b
        qk_head_dim, v_head_dim = key_mla, value_mla
    else:  # attn_kv_b; the head sizes are the plain key and value lengths
        qk_head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
        v_head_dim = meta.get(Keys.Attention.VALUE_LENGTH) or hidden // heads
    if not 0 < rope_dim < qk_head_dim:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is {rope_dim}, but keys have "
            f"{qk_head_dim} features: no part without RoPE is left"
        )
    # Lite models (V2-Lite) have attn_q and no q_lora_rank; llama.cpp requires it otherwise.
    lora_q = "blk.0.attn_q_a.weight" in gg.tensors
    eps = meta.require(Keys.Attention.LAYERNORM_RMS_EPS)
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rms_norm_eps": eps,
        "latent_norm_eps": eps,  # llama.cpp normalizes the latents with it too
        "kv_lora_rank": meta.require(Keys.Attention.KV_LORA_RANK),
        "q_lora_rank": meta.require(Keys.Attention.Q_LORA_RANK) if lora_q else None,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head_dim,
        "rope_interleave": True,  # llama.cpp's "normal" RoPE: adjacent pairs, unpermuted
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        NEXTN: nextn,
    }
    config.update(_experts(gg, meta, layers, vocab))
    config["rope_parameters"] = _rope(gg, rope_from_gguf(gg, meta, rope_dim, context), meta)
    if temperature:
        config["rope_parameters"].update(
            {"llama_4_scaling_beta": temperature, TEMPERATURE_LENGTH: temperature_length}
        )
    return config


def _experts(gg, meta: ArchMetadata, layers: int, vocab: int | None) -> dict[str, Any]:
    """The feed-forward's config fields: leading dense layers, the experts and their
    routing (model_type: deepseek_v3 for sigmoid gating, else deepseek_v2; youtu where
    every layer is dense)."""
    path = gg.path
    dense = meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between layers, "
                "which llmrun does not support"
            )
        width = width[0]
    fields: dict[str, Any] = {
        "first_k_dense_replace": dense,
        "moe_intermediate_size": width,
        "n_shared_experts": meta.require(Keys.LLM.EXPERT_SHARED_COUNT),
        # 0 (no key): llama.cpp leaves the weights unscaled.
        "routed_scaling_factor": meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        "norm_topk_prob": bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
    }
    ff = meta.get(Keys.LLM.FEED_FORWARD_LENGTH)
    if dense:
        if not ff:
            raise ModelFormatError(
                f"{path}: metadata {meta.name(Keys.LLM.FEED_FORWARD_LENGTH)!r} is missing; the "
                f"{dense} leading dense layers need it"
            )
        fields["intermediate_size"] = ff
    if dense >= layers:
        if gg.architecture != ARCH:
            raise UnsupportedError(
                f"{path}: a {gg.architecture} file without expert layers is not supported"
            )
        # Every block a leading dense one: Youtu-LLM's files (llmrun.models.youtu), the
        # expert keys the converter writes for llama.cpp's loader meaning nothing.
        return {"model_type": YOUTU, "intermediate_size": ff, "first_k_dense_replace": dense}
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    fields.update(n_routed_experts=count, num_experts_per_tok=used)
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is None:
        counts, sigmoid_vocab = SIGMOID_DEFAULT
        sigmoid = layers in counts and vocab == sigmoid_vocab
        gating = ExpertGatingFuncType.SIGMOID if sigmoid else ExpertGatingFuncType.SOFTMAX
    groups, groups_used = (
        meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0),
        meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0),
    )
    grouped = groups > 1  # llama.cpp ignores one group or none
    bias = f"blk.{dense}.{SELECTION_BIAS}.bias" in gg.tensors
    if gg.architecture == MISTRAL4:
        if gating != ExpertGatingFuncType.SOFTMAX or bias:
            raise UnsupportedError(
                f"{path}: a {MISTRAL4} file whose experts are not softmax-gated without a "
                f"selection bias ({SELECTION_BIAS}) is not supported"
            )
        fields["model_type"] = MISTRAL4  # its groups scored as V3's: llmrun.models.mistral4
    elif gating == ExpertGatingFuncType.SIGMOID:
        fields.update(model_type="deepseek_v3", topk_method="noaux_tc", scoring_func="sigmoid")
    elif gating == ExpertGatingFuncType.SOFTMAX:
        if bias:
            raise UnsupportedError(
                f"{path}: softmax-gated experts with a selection bias ({SELECTION_BIAS}) are "
                "not supported"
            )
        method = "group_limited_greedy" if grouped else "greedy"
        fields.update(model_type="deepseek_v2", topk_method=method, scoring_func="softmax")
    else:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; {gg.architecture} experts are gated by softmax "
            "or sigmoid"
        )
    # Stated either way: deepseek_v3's defaults (8 groups, 4 used) are not llama.cpp's.
    fields.update(n_group=groups if grouped else 1, topk_group=groups_used if grouped else 1)
    return fields


def _rope(gg, rope: dict[str, Any], meta: ArchMetadata) -> dict[str, Any]:
    """`rope` (gguf_config's reading of the RoPE keys) as llama.cpp applies it to a
    deepseek2 graph: none or YaRN, whose mscale_all_dim, the log multiplier / 0.1, scales
    the softmax too."""
    from llmrun.loading.gguf_config import ROPE_TENSORS

    path = gg.path
    for tensor in ROPE_TENSORS:
        if tensor in gg.tensors:
            raise UnsupportedError(
                f"{path}: RoPE factors ({tensor}) in a {gg.architecture} file are not supported"
            )
    if rope["rope_type"] not in ("default", "yarn"):
        raise UnsupportedError(
            f"{path}: RoPE scaling {rope['rope_type']!r} in a {gg.architecture} file is not supported "
            "(none or yarn are)"
        )
    if rope["rope_type"] == "yarn":
        log_mul = meta.get(Keys.Rope.SCALING_YARN_LOG_MUL)
        if not log_mul:
            raise UnsupportedError(
                f"{path}: YaRN without {meta.name(Keys.Rope.SCALING_YARN_LOG_MUL)} in a {gg.architecture} file "
                "is not supported (llama.cpp scales its attention in a way no DeepSeek config has)"
            )
        if not rope.get("factor"):
            raise ModelFormatError(f"{path}: YaRN without {meta.name(Keys.Rope.SCALING_FACTOR)}")
        if meta.get(Keys.Rope.SCALING_ATTN_FACTOR, 1.0) != 1.0:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.Rope.SCALING_ATTN_FACTOR)} in a {gg.architecture} file is not supported"
            )
        mscale = log_mul / YARN_LOG_MUL_FACTOR
        rope.update(mscale=mscale, mscale_all_dim=mscale)
    return rope


def hf_weights(weights: dict[str, Any], config: dict[str, Any], path: Any) -> dict[str, Any]:
    """A Hugging Face checkpoint's weights without its multi-token-prediction layers
    (those past num_hidden_layers, which transformers ignores too); a quantized one
    (DeepSeek-V3's FP8 release) is refused."""
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "?"
        raise UnsupportedError(
            f"{path}: {method} checkpoints are not supported; use a bf16 conversion or a GGUF"
        )
    layers = config.get("num_hidden_layers", 0)
    return {
        name: w
        for name, w in weights.items()
        if not (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers)
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The checkpoint's weights as the model takes them: each layer's attn_k_b and
    attn_v_b joined into kv_b_proj (join_kv_b), an attn_kv_b in blocks dequantized
    (the model takes kv_b_proj's rows as floats), and a zero selection bias for the
    sigmoid-gated layers of a file without one (llama.cpp's: the tensor is optional).
    `weight_type` is the loader's Weight."""
    import torch

    out = dict(weights)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        k_b, v_b = out.pop(prefix + K_B, None), out.pop(prefix + V_B, None)
        if (k_b is None) != (v_b is None):
            raise ModelFormatError(
                f"layer {layer} has one of attn_k_b and attn_v_b without the other"
            )
        kv_b = prefix + "self_attn.kv_b_proj.weight"
        if k_b is not None:
            out[kv_b] = weight_type(join_kv_b(k_b, v_b, config, layer))
        elif kv_b in out and out[kv_b].ggml_type is not None:
            # The model reads kv_b_proj's rows (absorbed MLA), never multiplies by it.
            out[kv_b] = weight_type(_floats(out[kv_b]))
        bias = prefix + "mlp.gate.e_score_correction_bias"
        sparse = layer >= config["first_k_dense_replace"]
        if config["model_type"] == "deepseek_v3" and sparse and bias not in out:
            out[bias] = weight_type(torch.zeros(config["n_routed_experts"]))
    return out


def join_kv_b(k_b, v_b, config: dict[str, Any], layer: int) -> torch.Tensor:
    """kv_b_proj [heads * (qk_nope + v), kv_lora_rank] from the loader's Weights of
    attn_k_b [heads, kv_lora_rank, qk_nope] and attn_v_b [heads, v, kv_lora_rank]."""
    import torch

    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    parts = []
    for w, shape, what in (
        (k_b, (heads, rank, nope), "attn_k_b"),
        (v_b, (heads, v_dim, rank), "attn_v_b"),
    ):
        if tuple(w.shape) != shape:
            raise ModelFormatError(
                f"blk.{layer}.{what} has shape {list(w.shape)}, but the metadata implies {list(shape)}"
            )
        parts.append(_floats(w).reshape(shape))
    k, v = parts
    dtype = k.dtype if k.dtype == v.dtype else torch.float32
    # [heads, rank, nope] -> [heads, nope, rank], the key rows of each head's block
    joined = torch.cat((k.transpose(1, 2).to(dtype), v.to(dtype)), dim=1)
    return joined.reshape(heads * (nope + v_dim), rank)


def _floats(w) -> torch.Tensor:
    """A loader Weight's values: float as stored, or its GGML blocks dequantized (f32)."""
    if w.ggml_type is None:
        return w.tensor
    from llmrun.quant.blocks import dequantize

    return dequantize(w.tensor, w.ggml_type)
