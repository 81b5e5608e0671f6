"""Write a random-weight model of Qwen2.5-0.5B's exact shape as GGUF files, one per type.

hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864, vocabulary 151936 with
the real Qwen2 tokenizer (llama.cpp's ggml-vocab-qwen2.gguf, fetched into
tests/data/cache/vocab by `python tests/data/fetch.py`; else ../shared/vocab), tied
embeddings, q/k/v biases. Types: F16, Q8_0, Q4_0 and Q4_K_M, the last mixed per
tensor as llama.cpp's quantizer mixes it for this shape: rows of 896 values are
not a whole number of 256-value K-blocks, so those tensors fall back to Q5_0
(for Q4_K) and Q8_0 (for Q6_K), and only ffn_down (rows of 4864) holds K-quants.

    python benchmarks/make_qwen_model.py [--types F16,Q8_0,Q4_0,Q4_K_M] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
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
FILE_TYPES = {
    "F16": "MOSTLY_F16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_K_M": "MOSTLY_Q4_K_M",
}
K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}


def more_bits(layer: int) -> bool:
    # llama.cpp gives the first and last eighth of the layers, and every third
    # in between, the larger type in its _M presets.
    return layer < LAYERS // 8 or layer >= 7 * LAYERS // 8 or (layer - LAYERS // 8) % 3 == 2


def tensor_type(preset: str, name: str, layer: int | None) -> T:
    if preset != "Q4_K_M":
        return T[preset]
    if name == "token_embd.weight":  # tied: it is also the output matrix
        return T.Q6_K
    if (
        name.endswith(("attn_v.weight", "ffn_down.weight"))
        and layer is not None
        and more_bits(layer)
    ):
        return T.Q6_K
    return T.Q4_K


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


def write(path: Path, preset: str) -> None:
    vocab = read_gguf(VOCAB, with_tensors=False).metadata
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(f"qwen2.5-0.5b-shaped random {preset}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(32768)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
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

    def add(name: str, shape: tuple[int, ...], layer: int | None = None) -> None:
        data = rng.standard_normal(shape, dtype=np.float32) * 0.02
        if len(shape) == 1:
            writer.add_tensor(name, data)
            return
        raw, qtype = encode(data, tensor_type(preset, name, layer))
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        if qtype == T.F16:
            writer.add_tensor(name, raw)
        else:
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

    add("token_embd.weight", (VOCAB_SIZE, HIDDEN))
    add("output_norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (HIDDEN,))
        add(p + "ffn_norm.weight", (HIDDEN,))
        add(p + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), i)
        add(p + "attn_q.bias", (HEADS * HEAD_DIM,))
        add(p + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), i)
        add(p + "attn_k.bias", (KV_HEADS * HEAD_DIM,))
        add(p + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), i)
        add(p + "attn_v.bias", (KV_HEADS * HEAD_DIM,))
        add(p + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), i)
        add(p + "ffn_gate.weight", (FFN, HIDDEN), i)
        add(p + "ffn_up.weight", (FFN, HIDDEN), i)
        add(p + "ffn_down.weight", (HIDDEN, FFN), i)
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
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()
    if not VOCAB.is_file():
        parser.error(f"{VOCAB} is missing: run python tests/data/fetch.py")
    args.out.mkdir(parents=True, exist_ok=True)
    for preset in args.types.split(","):
        if preset not in FILE_TYPES:
            parser.error(f"unknown type {preset} (choose from {', '.join(FILE_TYPES)})")
        write(args.out / f"qwen2.5-0.5b-shaped-{preset}.gguf", preset)


if __name__ == "__main__":
    main()
