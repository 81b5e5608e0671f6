"""Dots 3 Note at the loader edge: Hub folders and llama.cpp's "dots3note" GGUFs, as the
config and tensors of llmrun's dots3_note model.

Hub folders: the released checkpoint holds the language model under model.* with its
config at the top level, beside vision_encoder.*, audio_encoder.* (not run), and a
multi-token-prediction layer (model.mtp.*, model.layers.{num_hidden_layers}.*), which
transformers ignores too; a transformers-saved Dots3NoteForConditionalGeneration has it
under model.language_model.* and its config as text_config. Quantized releases (FP8)
are refused.

GGUFs are read as llama.cpp's converter writes them (conversion/dots3.py Dots3NoteModel,
on deepseek2's: head_count one per layer, MLA split into attn_k_b and attn_v_b in each
layer's own shapes, stacked experts, the sliding layers' sizes under *_swa keys, the
window and its per-layer flags, the indexer's sizes and per-layer flags, the MTP block
counted in block_count) and as src/models/dots3note.cpp reads them: every key it
requires, sigmoid-gated experts, shared experts expert_feed_forward_length wide, the
rope key's norm as attn_k_norm and the heads' gate as attn_gate. The converter folds
the latents' sqrt(hidden / rank) scale into the q_a and kv_a norms' weights (with
apply_mla_qkv_lora_rescale, as the released config sets it), so the model does not
scale them again.

llama.cpp's graph turns the indexer's RoPE in halves (NEOX) where transformers' (and
the released model's own code) turns adjacent pairs of the unpermuted weights it
converted; llmrun computes transformers' model, so the two differ once a sequence is
longer than index_topk.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2, dsa, experts, glm4_moe
from llmrun.loading.gguf_io import ArchMetadata

ARCH, MODEL_TYPE = "dots3note", "dots3_note_text"
MODEL_TYPES = ("dots3_note", MODEL_TYPE)
# Keys llama.cpp's constants.py has and the gguf package installed may not.
KV_LORA_RANK_SWA = "{arch}.attention.kv_lora_rank_swa"
KEY_LENGTH_MLA_SWA = "{arch}.attention.key_length_mla_swa"
VALUE_LENGTH_MLA_SWA = "{arch}.attention.value_length_mla_swa"
INDEXER_TYPES = dsa.INDEXER_TYPES
# GGUF tensor (after blk.N., without .weight) -> llmrun's module, beyond deepseek32's.
_LAYER_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.ATTN_K_NORM].split(".")[-1]: "self_attn.k_rope_only_layernorm",
    TENSOR_NAMES[MODEL_TENSOR.ATTN_GATE].split(".")[-1]: "self_attn.g_proj",
}
# The checkpoint's parts that are not the language model.
_OTHER_PREFIXES = (
    "vision_encoder.",
    "audio_encoder.",
    "audio_adapter.",
    "model.vision_tower.",
    "model.audio_tower.",
    "model.vision_encoder.",
    "model.audio_encoder.",
    "model.audio_adapter.",
    "model.mtp.",
)
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a dots3note GGUF tensor, or None if the model has no
    such tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        if parts[3] != "weight":
            return None
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return dsa.hf_name(gguf_name)


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], path: Any, weight_type: type
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """A Hub folder's config and weights as the model takes them, and whether the
    checkpoint is multimodal (its towers left out)."""
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "?"
        raise UnsupportedError(
            f"{path}: {method} checkpoints are not supported; use a bf16 conversion or a GGUF"
        )
    multimodal = "vision_config" in config or any(n.startswith(_OTHER_PREFIXES) for n in weights)
    text = config.get("text_config")
    if isinstance(text, dict):  # transformers' Dots3NoteConfig: the language model's own
        shared = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
        config = {
            **{k: config[k] for k in shared if k in config},
            **text,
            "model_type": MODEL_TYPE,
        }
    layers = config.get("num_hidden_layers", 0)
    out = {}
    for name, w in weights.items():
        name = re.sub(r"^model\.language_model\.", "model.", name)
        if name.startswith(_OTHER_PREFIXES):
            continue
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue  # the multi-token-prediction layer
        out[name] = w
    if any(_STACKED.fullmatch(name) for name in out):  # saved by transformers 5
        from llmrun.models.dots3_note_config import transformers_names

        sizes = transformers_names(config)
        out = experts.split_stacked(
            out, _STACKED, sizes["hidden_size"], sizes["moe_intermediate_size"], weight_type
        )
    return config, out, multimodal


def config_from_gguf(gg, rope_from_gguf) -> dict[str, Any]:
    """An HF-style dots3_note_text config from the file's metadata, read as llama.cpp's
    llama_model_dots3note::load_arch_hparams reads it."""
    path, arch = gg.path, gg.architecture
    meta = ArchMetadata.of(gg)

    def per_layer(template: str, layers: int) -> list[Any]:
        value = meta.require(template)
        value = value if isinstance(value, list) else [value] * layers
        if len(value) < layers:
            raise ModelFormatError(
                f"{path}: {meta.name(template)} has {len(value)} entries for {layers} layers"
            )
        return value[:layers]

    A = Keys.Attention
    gating = meta.require(Keys.LLM.EXPERT_GATING_FUNC)
    if gating != ExpertGatingFuncType.SIGMOID:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is {gating}; {arch} experts are "
            f"sigmoid-gated ({int(ExpertGatingFuncType.SIGMOID)}), the only gating its model has"
        )
    layers, nextn = glm4_moe.trunk_layers(gg, arch)
    hidden, context = meta.require(Keys.LLM.EMBEDDING_LENGTH), meta.require(Keys.LLM.CONTEXT_LENGTH)
    heads = per_layer(A.HEAD_COUNT, layers)
    sliding = per_layer(A.SLIDING_WINDOW_PATTERN, layers)
    indexed = per_layer(INDEXER_TYPES, layers)
    if any(not s and not i for s, i in zip(sliding, indexed, strict=True)):
        raise UnsupportedError(
            f"{path}: a {arch} layer neither sliding ({meta.name(A.SLIDING_WINDOW_PATTERN)}) nor "
            f"indexed ({meta.name(INDEXER_TYPES)}) is not supported (llama.cpp's graph has none)"
        )
    kinds = ["sliding_attention" if s else "indexed_attention" for s in sliding]
    rope_dim = meta.require(Keys.Rope.DIMENSION_COUNT)
    shapes = {
        "indexed_attention": (
            meta.require(A.KV_LORA_RANK),
            meta.require(A.KEY_LENGTH_MLA),
            meta.require(A.VALUE_LENGTH_MLA),
        ),
        "sliding_attention": (
            meta.require(KV_LORA_RANK_SWA),
            meta.require(KEY_LENGTH_MLA_SWA),
            meta.require(VALUE_LENGTH_MLA_SWA),
        ),
    }
    for kind, (_, qk, _) in shapes.items():
        if not 0 < rope_dim < qk:
            raise ModelFormatError(
                f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is {rope_dim}, but the "
                f"{kind} layers' keys have {qk} features: no part without RoPE is left"
            )
    first = kinds.index("indexed_attention") if "indexed_attention" in kinds else 0
    rank, qk, v = shapes[kinds[first]]
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads[first],
        "vocab_size": meta.get(Keys.LLM.VOCAB_SIZE)
        or len(gg.metadata.get(Keys.Tokenizer.LIST) or [])
        or gg.tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": context,
        "rms_norm_eps": meta.require(A.LAYERNORM_RMS_EPS),
        "q_lora_rank": meta.require(A.Q_LORA_RANK),
        "kv_lora_rank": rank,
        "qk_nope_head_dim": qk - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v,
        "layer_types": kinds,
        "sliding_window": meta.require(A.SLIDING_WINDOW),
        "per_layer_config": {},
        "index_n_heads": meta.require(A.Indexer.HEAD_COUNT),
        "index_head_dim": meta.require(A.Indexer.KEY_LENGTH),
        "index_topk": meta.require(A.Indexer.TOP_K),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "lora_rescale": False,  # the converter folded it into the norms' weights
        glm4_moe.NEXTN: nextn,
    }
    for i, kind in enumerate(kinds):
        rank_l, qk_l, v_l = shapes[kind]
        own = {
            "num_attention_heads": heads[i],
            "kv_lora_rank": rank_l,
            "qk_nope_head_dim": qk_l - rope_dim,
            "v_head_dim": v_l,
        }
        differ = {k: value for k, value in own.items() if value != config[k]}
        if differ:
            config["per_layer_config"][i] = differ
    meta.require(Keys.LLM.LEADING_DENSE_BLOCK_COUNT)  # required by llama.cpp, 0 by deepseek2's
    fields = deepseek2._experts(gg, meta, layers, config["vocab_size"])
    dense = fields["first_k_dense_replace"]
    fields.update(
        model_type=MODEL_TYPE,
        # llama.cpp's shared experts are n_ff_exp * n_expert_shared wide.
        shared_experts_intermediate_size=fields["moe_intermediate_size"],
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
    )
    config.update(fields)
    theta_swa = meta.require(Keys.Rope.FREQ_BASE_SWA)
    config["rope_parameters"] = {
        "indexed_attention": rope_from_gguf(gg, meta, rope_dim, context),
        "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa},
    }
    return config


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The checkpoint's weights as the model takes them: each layer's attn_k_b and
    attn_v_b joined into kv_b_proj in that layer's shapes, and a zero selection bias
    where a file has none."""
    import torch

    out = dict(weights)
    overrides = {int(i): v for i, v in config["per_layer_config"].items()}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        k_b, v_b = out.pop(prefix + deepseek2.K_B, None), out.pop(prefix + deepseek2.V_B, None)
        if k_b is None or v_b is None:
            raise ModelFormatError(f"layer {layer} lacks attn_k_b or attn_v_b (dots3note has both)")
        own = {**config, **overrides.get(layer, {})}
        kv_b = deepseek2.join_kv_b(k_b, v_b, own, layer)
        out[prefix + "self_attn.kv_b_proj.weight"] = weight_type(kv_b)
        bias = prefix + "mlp.gate.e_score_correction_bias"
        if config["mlp_layer_types"][layer] == "sparse" and bias not in out:
            out[bias] = weight_type(torch.zeros(config["n_routed_experts"]))
    return out


def cache_layout(config: dict[str, Any]) -> tuple[list[tuple[int, int]], list[int | None]]:
    """Each layer's cached (heads, width) and window, torch-free (llmrun show)."""
    from llmrun.models.dots3_note_config import cache_layout

    return cache_layout(config)
