"""Tiny GLM-4 and ERNIE 4.5 models for their tests: transformers' models with
helpers.randomize()'s weights, our models of them, and GGUFs written as llama.cpp's
converter writes these families (conversion/glm.py Glm4Model, conversion/ernie.py
Ernie4_5Model: HF's q/k rows unpermuted, the rotated width as rope.dimension_count for
GLM-4, 1-D tensors in F32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from helpers import BASE, STORIES_GGUF, randomize

from llmrun.loading.gguf_io import read_gguf

# GGUF tensor names by HF module, as gguf-py's tensor_mapping.py maps them for each arch.
COMMON_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLM4_NAMES = {
    **COMMON_NAMES,
    "post_self_attn_layernorm": "post_attention_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "mlp.gate_up_proj": "ffn_up",
}
ERNIE_MOE_NAMES = {
    **COMMON_NAMES,
    "mlp.gate": "ffn_gate_inp",
    "mlp.moe_statics.e_score_correction": "exp_probs_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
NAMES = {"glm4": GLM4_NAMES, "ernie4_5": COMMON_NAMES, "ernie4_5_moe": ERNIE_MOE_NAMES}
ARCHS = {"ernie4_5_moe": "ernie4_5-moe"}
EXPERT_STACKS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(model_type: str, seed: int = 0, **overrides):
    """A transformers model of BASE's sizes and `overrides`, randomize()'s weights."""
    import transformers

    config = transformers.AutoConfig.for_model(**{**BASE, "model_type": model_type, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hub_state(model) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's keys: transformers 5 holds an ERNIE 4.5 MoE
    layer's experts fused (experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I])
    and its router bias under mlp.gate; the checkpoints have one key per expert and
    projection, and the bias under mlp.moe_statics."""
    out = {}
    for key, value in model.state_dict().items():
        head, _, tail = key.partition(".mlp.")
        if tail == "experts.gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.gate_proj.weight"] = value[e, :width]
                out[f"{head}.mlp.experts.{e}.up_proj.weight"] = value[e, width:]
        elif tail == "experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.down_proj.weight"] = value[e]
        elif tail == "gate.moe_statics.e_score_correction_bias":
            out[f"{head}.mlp.moe_statics.e_score_correction_bias"] = value
        else:
            out[key] = value
    return out


def gguf_tensors(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Hub-named weights under llama.cpp's names as numpy arrays, each layer's experts
    stacked [experts, rows, cols] per projection (conversion/ernie.py)."""
    out, stacks = {}, {}
    for name, tensor in state.items():
        data = tensor.detach().float().numpy()
        parts = name.split(".")
        if "experts" in parts and "shared_experts" not in parts:
            layer, expert, projection = parts[2], int(parts[5]), parts[6]
            stacks.setdefault(f"blk.{layer}.{EXPERT_STACKS[projection]}.weight", {})[expert] = data
        else:
            out[name] = data
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in sorted(experts)])
    return out


def gguf_name(hf_name: str, model_type: str) -> str:
    if hf_name.startswith("blk."):  # a stack of experts, named already
        return hf_name
    names = NAMES[model_type]
    # conversion/base.py renames the router bias before mapping it.
    hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
    module, _, suffix = hf_name.rpartition(".")
    if module in names:
        return f"{names[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{names[rest]}.{suffix}"


def write_gguf(
    path: Path, model, qtype=None, state: dict | None = None, arch: str | None = None, **metadata
) -> Path:
    """`model` (a transformers GLM-4 or ERNIE 4.5) as llama.cpp's converter writes it, with
    stories260K's tokenizer; 2-D weights in `qtype` (default F32), from `state` where
    given (else the model's); under `arch` where given (else its model_type).
    `metadata`: writer method name -> value, added or (None) left out."""
    import gguf

    config = model.config
    model_type = config.model_type
    qtype = qtype or gguf.GGMLQuantizationType.F32
    writer = gguf.GGUFWriter(str(path), arch or ARCHS.get(model_type, model_type))
    head_dim = config.head_dim
    rope = config.rope_parameters
    fields = {
        "add_block_count": config.num_hidden_layers,
        "add_context_length": config.max_position_embeddings,
        "add_embedding_length": config.hidden_size,
        "add_feed_forward_length": config.intermediate_size,
        "add_head_count": config.num_attention_heads,
        "add_head_count_kv": config.num_key_value_heads,
        "add_rope_freq_base": rope["rope_theta"],
        "add_layer_norm_rms_eps": config.rms_norm_eps,
        "add_key_length": head_dim,
        "add_value_length": head_dim,
    }
    if model_type == "glm4":
        rotated = int(head_dim * rope.get("partial_rotary_factor", 0.5))
        fields["add_rope_dimension_count"] = rotated
    if model_type == "ernie4_5_moe":
        fields |= {
            "add_expert_count": config.moe_num_experts,
            "add_expert_used_count": config.moe_k,
            "add_interleave_moe_layer_step": config.moe_layer_interval,
            "add_leading_dense_block_count": config.moe_layer_start_index,
            "add_expert_feed_forward_length": config.moe_intermediate_size,
            "add_expert_shared_count": config.moe_num_shared_experts,
            # What conversion/ernie.py writes, whatever the shared experts' width.
            "add_expert_shared_feed_forward_length": config.intermediate_size
            // config.num_key_value_heads,
        }
    for method, value in {**fields, **metadata}.items():
        if value is not None:
            getattr(writer, method)(value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, data in gguf_tensors(state or hub_state(model)).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = gguf_name(name, model_type)
        if not quantized(name, data) or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data))
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantized(gguf_name: str, data: np.ndarray) -> bool:
    """Whether llama.cpp's converter stores a tensor in the file's quantized type: not
    1-D tensors, routers or biases (conversion/base.py prepare_tensors)."""
    return data.ndim > 1 and gguf_name.endswith(".weight") and "ffn_gate_inp" not in gguf_name


def dequantized(model, qtype) -> dict[str, torch.Tensor]:
    """The model's state dict with its weight matrices (experts' too) rounded through
    `qtype` (gguf's quantizer and dequantizer): what a GGUF of that type holds."""
    import gguf

    def rounded(v: torch.Tensor) -> torch.Tensor:
        raw = gguf.quants.quantize(v.numpy(), qtype)
        return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(v.shape))

    return {
        k: rounded(v) if v.dim() >= 2 and not k.endswith(("mlp.gate.weight", "_bias")) else v
        for k, v in model.state_dict().items()
    }


def decoded(model, ids: torch.Tensor = IDS, prefill: int = 10) -> torch.Tensor:
    """llmrun's logits through a KV cache: a prefill of `prefill`, then one token at a time."""
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    out = []
    with torch.no_grad():
        steps = [(0, prefill)] + [(i, i + 1) for i in range(prefill, ids.shape[1])]
        for start, end in steps:
            out.append(model(ids[:, start:end], torch.arange(start, end)[None], cache))
    return torch.cat(out, dim=1)


def full(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None])
