"""Write a random-weight model of Gemma 3 1B's exact shape as GGUF files, one per type.

hidden 1152, 26 layers (five sliding-window layers of 512 to each global one, as
llama.cpp reads a gemma3 GGUF without a pattern key), 4 heads of 256, 1 KV head,
FFN 6912, GeGLU, q/k norms, RoPE bases 1e6 (global) and 1e4 (local), vocabulary
262144, tied embeddings; the metadata and norm weights (stored as 1 + w) as
llama.cpp's converter writes them. No Gemma tokenizer is at hand (llama.cpp ships
no ggml-vocab-gemma), so the vocabulary is a synthetic SentencePiece one of the
real size and layout of special tokens (<pad> <eos> <bos> <unk>, <start_of_turn>
105, <end_of_turn> 106, byte tokens): the benchmarks feed random token ids, and
the embedding and output matrix are what decoding reads. Types: F16, Q8_0, Q4_0
and Q4_K_M, the last mixed per tensor as llama.cpp's quantizer mixes it for this
shape: rows of 1152 values are not whole 256-value K-blocks, so those tensors
fall back to Q5_0 (for Q4_K) and Q8_0 (for Q6_K, the tied embedding too); only
attn_output (rows of 1024) and ffn_down (rows of 6912) hold K-quants.

    python benchmarks/make_gemma_model.py [--types F16,Q8_0,Q4_0,Q4_K_M] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import TokenType
from make_qwen_model import FILE_TYPES, encode

HERE = Path(__file__).resolve().parent
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB_SIZE = 1152, 6912, 26, 4, 1, 256, 262144
WINDOW, CONTEXT = 512, 32768
SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>"}
SPECIAL.update({105: "<start_of_turn>", 106: "<end_of_turn>"})
BYTES_AT = 238  # the 256 byte tokens <0x00> .. <0xFF>


def more_bits(layer: int) -> bool:
    # llama.cpp's use_more_bits: the first and last eighth of the layers, and every
    # third in between, get the larger type in its _M presets.
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


def add_vocabulary(writer: gguf.GGUFWriter) -> None:
    tokens, types = [], []
    for i in range(VOCAB_SIZE):
        if i in SPECIAL:
            tokens.append(SPECIAL[i])
            types.append(TokenType.UNKNOWN if SPECIAL[i] == "<unk>" else TokenType.CONTROL)
        elif BYTES_AT <= i < BYTES_AT + 256:
            tokens.append(f"<0x{i - BYTES_AT:02X}>")
            types.append(TokenType.BYTE)
        else:
            tokens.append(f"\u2581w{i}")
            types.append(TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(VOCAB_SIZE)])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)


def write(path: Path, preset: str) -> None:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name(f"gemma-3-1b-shaped random {preset}")
    # The keys llama.cpp's Gemma3Model converter writes for Gemma 3 1B.
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_rope_freq_base_swa(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(WINDOW)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[preset]])
    add_vocabulary(writer)

    rng = np.random.default_rng(0)
    counts: dict[str, int] = {}

    def add(name: str, shape: tuple[int, ...], layer: int | None = None) -> None:
        data = rng.standard_normal(shape, dtype=np.float32) * 0.02
        if len(shape) == 1:  # a norm: llama.cpp stores Gemma's as 1 + w
            writer.add_tensor(name, data + 1)
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
        add(p + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), i)
        add(p + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), i)
        add(p + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), i)
        add(p + "attn_q_norm.weight", (HEAD_DIM,))
        add(p + "attn_k_norm.weight", (HEAD_DIM,))
        add(p + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), i)
        add(p + "post_attention_norm.weight", (HIDDEN,))
        add(p + "ffn_norm.weight", (HIDDEN,))
        add(p + "ffn_gate.weight", (FFN, HIDDEN), i)
        add(p + "ffn_up.weight", (FFN, HIDDEN), i)
        add(p + "ffn_down.weight", (HIDDEN, FFN), i)
        add(p + "post_ffw_norm.weight", (HIDDEN,))
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
    args.out.mkdir(parents=True, exist_ok=True)
    for preset in args.types.split(","):
        if preset not in FILE_TYPES:
            parser.error(f"unknown type {preset} (choose from {', '.join(FILE_TYPES)})")
        write(args.out / f"gemma-3-1b-shaped-{preset}.gguf", preset)


if __name__ == "__main__":
    main()
