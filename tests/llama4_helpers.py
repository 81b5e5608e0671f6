"""Llama 4 as llama.cpp's converter writes it (conversion/llama.py Llama4Model): a
"llama4" GGUF with TextModel's keys, feed_forward_length the dense layers' width,
expert_feed_forward_length and interleave_moe_layer_step, q/k rows as they are, the
fused experts split and stacked, Llama 3 RoPE scaling as a rope_freqs tensor; for the text
tests (tests/models/test_llama4.py) and the image ones (llama4_vision_helpers)."""

import re

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, gguf_name

from llmrun.loading.gguf_io import read_gguf

# HF module of a layer -> llama.cpp's tensor, where Llama 4 differs from helpers'.
GGUF_LAYER_NAMES = {
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
    "feed_forward.router": "ffn_gate_inp",
    "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
    "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
    "feed_forward.shared_expert.down_proj": "ffn_down_shexp",
}
FUSED = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)")


def llama3_freq_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3 RoPE scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(hf) -> dict[str, torch.Tensor]:
    """The model's tensors under llama.cpp's names, the experts of a layer stacked as
    the converter stacks them ([experts, out, in])."""
    out = {}
    for name, tensor in hf.state_dict().items():
        fused = FUSED.fullmatch(name)
        if fused is None:
            module, _, suffix = name.rpartition(".")
            rest = module.split(".", 3)[-1]
            if rest in GGUF_LAYER_NAMES:
                out[f"blk.{module.split('.')[2]}.{GGUF_LAYER_NAMES[rest]}.{suffix}"] = tensor
            else:
                out[gguf_name(name)] = tensor
            continue
        layer, part = fused.groups()
        stacked = tensor.transpose(1, 2).contiguous()  # [E, in, out] -> [E, out, in]
        if part == "gate_up_proj":
            gate, up = stacked.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            out[f"blk.{layer}.ffn_up_exps.weight"] = up
        else:
            out[f"blk.{layer}.ffn_down_exps.weight"] = stacked
    return out


def write_llama4_gguf(
    path,
    hf,
    qtype=None,
    sliding_window=None,
    rope_dims=None,
    swa_base=None,
    experts=None,
    extra_tokens=(),
    extra=None,
):
    """The model (a Llama4ForCausalLM) as llama.cpp's converter writes Llama 4, matrices
    (the experts' stacks too) in `qtype` (default F32), with stories260K's vocabulary and
    `extra_tokens` after it as control tokens; `extra(writer)` adds keys of its own. sliding_window,
    rope_dims, swa_base, experts (the expert count): keys the converter writes for other
    models, for the refusals."""
    config = hf.config
    head_dim = rope_dims or config.head_dim
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(str(path), "llama4")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size_mlp)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts if experts is None else experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_interleave_moe_layer_step(config.interleave_moe_layer_step)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if swa_base is not None:
        writer.add_rope_freq_base_swa(swa_base)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_freq_factors(rope, config.head_dim))
    tensors = gguf_tensors(hf)
    for name in [n for n, t in tensors.items() if t.dim() == 3]:
        data = tensors.pop(name).numpy()
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    if extra is not None:
        extra(writer)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    added = list(extra_tokens)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *added])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(added)])
    control = [gguf.TokenType.CONTROL] * len(added)
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        if data.ndim == 2 and qtype is not None:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
