"""Write a random-weight model of Qwen2.5-0.5B's exact shape as GGUF files, one per type.

hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864, vocabulary 151936 with
the real Qwen2 tokenizer (llama.cpp's ggml-vocab-qwen2.gguf, fetched into
tests/data/cache/vocab by `python tests/data/fetch.py`; else ../shared/vocab), tied
embeddings, q/k/v biases. Types: F16, Q8_0, Q4_0 and Q4_K_M, the last mixed per
tensor as llama.cpp's quantizer mixes it for this shape: rows of 896 values are
not a whole number of 256-value K-blocks, so those tensors fall back to Q5_0
(for Q4_K) and Q8_0 (for Q6_K), and only ffn_down (rows of 4864) holds K-quants.

    python benchmarks/make_qwen_model.py [--types F16,Q8_0,Q4_0,Q4_K_M] [--out benchmarks/out]

`--shape 7b` writes Qwen2.5-7B's shape instead (hidden 3584, 28 layers, 28 heads, 4 KV
heads, FFN 18944, an untied output matrix; the tokenizer's 151936 rows of vocabulary
where the real model pads to 152064), of random valid blocks rather than quantized random floats (quantizing 7.6
billion floats in numpy takes far longer than a GPU check may): quants uniform, f16
scales small, so the file has the size and layout a 7B file has; for speed, not for
text. Every row is a whole number of K-blocks there, so Q4_K_M is Q4_K and Q6_K only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from kquants import quantize_q4_k, quantize_q6_k

from llmrun.loading.gguf_io import read_gguf

HERE = Path(__file__).resolve().parent
FETCHED_VOCAB = HERE.parent / "tests/data/cache/vocab/ggml-vocab-qwen2.gguf"
SHARED_VOCAB = HERE.parents[1] / "shared/vocab/ggml-vocab-qwen2.gguf"
VOCAB = SHARED_VOCAB if SHARED_VOCAB.is_file() and not FETCHED_VOCAB.is_file() else FETCHED_VOCAB
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB_SIZE = 896, 4864, 24, 14, 2, 64, 151936


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool


SHAPES = {
    "0.5b": Shape("0.5b", HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB_SIZE, True),
    "7b": Shape("7b", 3584, 18944, 28, 28, 4, 128, VOCAB_SIZE, False),
}
# Offsets of the f16 scales in each block, for random blocks (ggml-common.h).
F16_FIELDS = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q5_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
FILE_TYPES = {
    "F16": "MOSTLY_F16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_K_M": "MOSTLY_Q4_K_M",
}
K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}


def more_bits(layer: int, layers: int) -> bool:
    # llama.cpp gives the first and last eighth of the layers, and every third
    # in between, the larger type in its _M presets.
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(preset: str, name: str, layer: int | None, shape: Shape) -> T:
    if preset != "Q4_K_M":
        return T[preset]
    if name in ("token_embd.weight", "output.weight") and (shape.tied or name == "output.weight"):
        return T.Q6_K  # the output matrix (the embedding, where tied)
    if (
        name.endswith(("attn_v.weight", "ffn_down.weight"))
        and layer is not None
        and more_bits(layer, shape.layers)
    ):
        return T.Q6_K
    return T.Q4_K


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random valid `qtype` blocks with small f16 scales."""
    size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = np.abs(rng.standard_normal(len(raw), dtype=np.float32)) * 2e-3 + 1e-4
        raw[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def encode(data: np.ndarray, qtype: T) -> np.ndarray:
    if data.shape[-1] % 256 and qtype in K_FALLBACK:
        qtype = K_FALLBACK[qtype]
    if qtype == T.F16:
        return data.astype(np.float16), T.F16
    if qtype == T.Q4_K:
        return quantize_q4_k(data), qtype
    if qtype == T.Q6_K:
        return quantize_q6_k(data), qtype
    return gguf.quants.quantize(data, qtype), qtype


def write(path: Path, preset: str, shape: Shape = SHAPES["0.5b"]) -> None:
    vocab = read_gguf(VOCAB, with_tensors=False).metadata
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(f"qwen2.5-{shape.name}-shaped random {preset}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[preset]])
    for key, value in vocab.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            writer.add_key_value(key, value, V.STRING)
        elif isinstance(value, int):
            writer.add_key_value(key, value, V.UINT32)
        else:
            writer.add_key_value(
                key, value, V.ARRAY, sub_type=V.STRING if isinstance(value[0], str) else V.INT32
            )

    rng = np.random.default_rng(0)
    counts: dict[str, int] = {}

    def add(name: str, dims: tuple[int, ...], layer: int | None = None) -> None:
        if len(dims) == 1:
            writer.add_tensor(name, rng.standard_normal(dims, dtype=np.float32) * 0.02)
            return
        qtype = tensor_type(preset, name, layer, shape)
        if shape.name != "0.5b":
            raw = random_blocks(qtype, *dims, rng)
        else:
            raw, qtype = encode(rng.standard_normal(dims, dtype=np.float32) * 0.02, qtype)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        if qtype == T.F16:
            writer.add_tensor(name, raw)
        else:
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

    hidden, q_width, kv_width = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    )
    add("token_embd.weight", (shape.vocab, hidden))
    add("output_norm.weight", (hidden,))
    if not shape.tied:
        add("output.weight", (shape.vocab, hidden))
    for i in range(shape.layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (hidden,))
        add(p + "ffn_norm.weight", (hidden,))
        add(p + "attn_q.weight", (q_width, hidden), i)
        add(p + "attn_q.bias", (q_width,))
        add(p + "attn_k.weight", (kv_width, hidden), i)
        add(p + "attn_k.bias", (kv_width,))
        add(p + "attn_v.weight", (kv_width, hidden), i)
        add(p + "attn_v.bias", (kv_width,))
        add(p + "attn_output.weight", (hidden, q_width), i)
        add(p + "ffn_gate.weight", (shape.ffn, hidden), i)
        add(p + "ffn_up.weight", (shape.ffn, hidden), i)
        add(p + "ffn_down.weight", (hidden, shape.ffn), i)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mix = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB ({mix})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_K_M")
    parser.add_argument("--shape", choices=SHAPES, default="0.5b")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()
    if not VOCAB.is_file():
        parser.error(f"{VOCAB} is missing: run python tests/data/fetch.py")
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    for preset in args.types.split(","):
        if preset not in FILE_TYPES or (shape.name != "0.5b" and preset == "F16"):
            parser.error(f"unknown type {preset} (choose from {', '.join(FILE_TYPES)})")
        write(args.out / f"qwen2.5-{shape.name}-shaped-{preset}.gguf", preset, shape)


if __name__ == "__main__":
    main()
