"""Tiny llama-architecture GGUFs for the quantize tests, written tensor by tensor with
GGML's names (so the layer rules of llama.cpp's quantizer have GQA, tied or untied
output, 8-expert stacks and 16 layers to act on), and the reference bytes' source."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# Written once by llama.cpp's llama_model_quantize (the llama-cpp-python 0.3.36 wheel)
# from these models, to record the digests the tests hold.
VARIANTS = {
    "gqa4-tied": dict(layers=16, kv_heads=1, tied=True),
    "mha-untied": dict(layers=16, kv_heads=4, tied=False),
    "8-experts": dict(layers=4, kv_heads=2, tied=False, experts=8),
    "80-layers-gqa": dict(layers=80, kv_heads=1, tied=False),  # llama.cpp's "70B" rules
}


def write_model(
    path: Path,
    *,
    layers: int = 16,
    hidden: int = 256,
    ffn: int = 256,
    heads: int = 4,
    kv_heads: int = 1,
    vocab: int = 32,
    tied: bool = True,
    experts: int = 0,
    seed: int | None = None,
) -> Path:
    """A llama GGUF: 2-D weights F16 (normal(0, 1) from `seed`, or zeros where the
    test reads only the header), norms F32."""
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int) -> None:
        if seed is None:
            data = np.zeros(shape, np.float32)
        else:
            data = rng.standard_normal(shape, np.float32)
        writer.add_tensor(name, data if len(shape) == 1 else data.astype(np.float16))

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    if not tied:
        add("output.weight", vocab, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        if experts:
            add(f"blk.{i}.ffn_gate_inp.weight", experts, hidden)
            add(f"blk.{i}.ffn_gate_exps.weight", experts, ffn, hidden)
            add(f"blk.{i}.ffn_up_exps.weight", experts, ffn, hidden)
            add(f"blk.{i}.ffn_down_exps.weight", experts, hidden, ffn)
        else:
            add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
            add(f"blk.{i}.ffn_up.weight", ffn, hidden)
            add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_falcon_model(path: Path, layers: int = 8, hidden: int = 256, ffn: int = 512) -> Path:
    """A falcon GGUF (fused attn_qkv, no gate; llama.cpp has falcon rules of its own),
    zeros: for the types only."""
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, np.zeros(shape, np.float16 if len(shape) > 1 else np.float32))

    add("token_embd.weight", 32, hidden)
    add("output_norm.weight", hidden)
    add("output_norm.bias", hidden)
    add("output.weight", 32, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_norm.bias", hidden)
        add(f"blk.{i}.attn_qkv.weight", hidden + 2 * hidden // 4, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def type_lines(path: Path) -> str:
    """'name TYPE' per tensor of a GGUF, in file order: what a type digest covers."""
    from llmrun.loading.gguf_io import read_gguf

    return "".join(
        f"{info.name} {info.ggml_type.name}\n" for info in read_gguf(path).tensors.values()
    )
