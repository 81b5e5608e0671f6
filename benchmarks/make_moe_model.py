"""Write random-weight mixture-of-experts GGUFs in the exact per-layer shapes of
Qwen3-30B-A3B and Mixtral 8x7B, with fewer layers so they fit a small machine.

qwen3-30b-a3b: hidden 2048, 32 heads, 4 KV heads, head_dim 128, q/k norms, 128
  experts of width 768, 8 a token (renormalized), vocabulary 151936 with the real
  Qwen2 tokenizer, untied output; 48 layers in the real model (default here: 8).
mixtral-8x7b: hidden 4096, 32 heads, 8 KV heads, 8 experts of width 14336, 2 a
  token, vocabulary 32000 with the Llama SentencePiece tokenizer; arch llama with
  expert_count, as llama.cpp writes it; 32 layers in the real model (default: 2).

Written as llama.cpp's converter writes MoE models: experts stacked per layer in
ffn_{gate,up,down}_exps [experts, rows, cols], the router ffn_gate_inp in F32, its
expert metadata keys. Types: Q8_0, and Q4_K_M mixed per tensor as llama.cpp's
quantizer mixes it (llama_tensor_get_type): Q4_K, with Q6_K for output.weight and
for attn_v and ffn_down(_exps) in the first and last eighth of the layers and every
third in between; Mixtral's (8 experts) attn_k and attn_v in Q8_0. The quantized
tensors are random valid blocks with small scales, not quantized floats: only the
layout and sizes matter for speed, and random bytes are quick to make. Tensors are
streamed to the file one at a time, so memory stays near one expert stack.

    python benchmarks/make_moe_model.py [--shapes qwen3-30b-a3b,mixtral-8x7b]
        [--types Q8_0,Q4_K_M] [--layers N] [--out benchmarks/out]

Vocabularies: llama.cpp's ggml-vocab-qwen2.gguf and ggml-vocab-llama-spm.gguf,
fetched into tests/data/cache/vocab by `python tests/data/fetch.py`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, Keys
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from llmrun.loading.gguf_io import read_gguf

HERE = Path(__file__).resolve().parent
VOCABS = HERE.parent / "tests/data/cache/vocab"
FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_K_M": "MOSTLY_Q4_K_M"}
# Byte offsets of each type's f16 scale fields in a block, set to small values.
F16_FIELDS = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
SCALE = {T.Q8_0: 2.5e-4, T.Q4_K: 1e-4, T.Q6_K: 1.5e-5}  # weights of about 0.02


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int
    expert_width: int
    vocab_size: int
    vocab_file: str
    layers: int  # default, fewer than the real model's
    real_layers: int
    rope_theta: float
    qk_norm: bool


SHAPES = {
    "qwen3-30b-a3b": Shape(
        "qwen3moe", 2048, 32, 4, 128, 128, 8, 768, 151936, "ggml-vocab-qwen2.gguf", 8, 48,
        1e6, True,
    ),
    "mixtral-8x7b": Shape(
        "llama", 4096, 32, 8, 128, 8, 2, 14336, 32000, "ggml-vocab-llama-spm.gguf", 2, 32,
        1e6, False,
    ),
}  # fmt: skip


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(preset: str, shape: Shape, name: str, layer: int | None, layers: int) -> T:
    if preset == "Q8_0":
        return T.Q8_0
    if name == "output.weight":
        return T.Q6_K
    if shape.experts == 8 and name.endswith(("attn_k.weight", "attn_v.weight")):
        return T.Q8_0  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    down = name.endswith(("attn_v.weight", "ffn_down_exps.weight"))
    if down and layer is not None and more_bits(layer, layers):
        return T.Q6_K
    return T.Q4_K


def random_blocks(qtype: T, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks for weights of shape `dims`: uint8 [.., rows, row bytes]."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(dims)) // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = (rng.random(n_blocks, dtype=np.float32) + 0.5) * SCALE[qtype]
        raw[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*dims[:-1], -1)


def tensors(shape: Shape, layers: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, torch-order shape, layer) of every tensor, in file order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e, w = shape.experts, shape.expert_width
    out = [("token_embd.weight", (shape.vocab_size, h), None), ("output_norm.weight", (h,), None)]
    out.append(("output.weight", (shape.vocab_size, h), None))
    for i in range(layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), i), (p + "ffn_norm.weight", (h,), i)]
        out += [
            (p + "attn_q.weight", (q, h), i),
            (p + "attn_k.weight", (kv, h), i),
            (p + "attn_v.weight", (kv, h), i),
            (p + "attn_output.weight", (h, q), i),
        ]
        if shape.qk_norm:
            out += [(p + "attn_q_norm.weight", (shape.head_dim,), i)]
            out += [(p + "attn_k_norm.weight", (shape.head_dim,), i)]
        out += [
            (p + "ffn_gate_inp.weight", (e, h), i),
            (p + "ffn_gate_exps.weight", (e, w, h), i),
            (p + "ffn_up_exps.weight", (e, w, h), i),
            (p + "ffn_down_exps.weight", (e, h, w), i),
        ]
    return out


def add_vocab(writer: gguf.GGUFWriter, vocab_path: Path) -> None:
    for key, value in read_gguf(vocab_path, with_tensors=False).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            writer.add_key_value(key, value, V.STRING)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, V.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, V.UINT32)
        elif isinstance(value[0], str):
            writer.add_key_value(key, value, V.ARRAY, sub_type=V.STRING)
        elif isinstance(value[0], float):
            writer.add_key_value(key, value, V.ARRAY, sub_type=V.FLOAT32)
        else:
            writer.add_key_value(key, value, V.ARRAY, sub_type=V.INT32)


def write(path: Path, name: str, shape: Shape, preset: str, layers: int) -> None:
    arch = shape.arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{name}-shaped random {preset}, {layers} of {shape.real_layers} layers")
    writer.add_block_count(layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden)
    # Mixtral's n_ff is its experts' width; Qwen3-MoE's dense width (unused there).
    writer.add_feed_forward_length(shape.expert_width if arch == "llama" else 6144)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6 if arch == "qwen3moe" else 1e-5)
    writer.add_uint32(Keys.LLM.EXPERT_COUNT.format(arch=arch), shape.experts)
    writer.add_uint32(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch), shape.used)
    if arch == "qwen3moe":
        writer.add_uint32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch), shape.expert_width)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[preset]])
    add_vocab(writer, VOCABS / shape.vocab_file)

    plan = []
    for tensor_name, dims, layer in tensors(shape, layers):
        if len(dims) == 1 or tensor_name.endswith("ffn_gate_inp.weight"):
            plan.append((tensor_name, dims, None))  # F32, as the converter keeps them
            nbytes = int(np.prod(dims)) * 4
            writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), nbytes)
            continue
        qtype = tensor_type(preset, shape, tensor_name, layer, layers)
        block, type_size = GGML_QUANT_SIZES[qtype]
        byte_shape = (*dims[:-1], dims[-1] // block * type_size)
        plan.append((tensor_name, dims, qtype))
        writer.add_tensor_info(
            tensor_name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    counts: dict[str, int] = {}
    for tensor_name, dims, qtype in plan:
        if qtype is None:
            if tensor_name.endswith("norm.weight"):
                data = np.ones(dims, dtype=np.float32)
            else:
                data = rng.standard_normal(dims, dtype=np.float32) * 0.02
            writer.write_tensor_data(data)
            continue
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        writer.write_tensor_data(random_blocks(qtype, dims, rng))
    writer.close()
    mix = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB ({mix})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--types", default=",".join(FILE_TYPES))
    parser.add_argument("--layers", type=int, help="layers (default: 8 Qwen3-MoE, 2 Mixtral)")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"unknown shape {name} (choose from {', '.join(SHAPES)})")
        shape = SHAPES[name]
        if not (VOCABS / shape.vocab_file).is_file():
            parser.error(f"{VOCABS / shape.vocab_file} is missing: run python tests/data/fetch.py")
        for preset in args.types.split(","):
            if preset not in FILE_TYPES:
                parser.error(f"unknown type {preset} (choose from {', '.join(FILE_TYPES)})")
            layers = args.layers or shape.layers
            write(args.out / f"{name}-shaped-L{layers}-{preset}.gguf", name, shape, preset, layers)


if __name__ == "__main__":
    main()
