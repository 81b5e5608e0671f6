"""Write a random-weight GGUF in gpt-oss-20b's exact per-layer shapes, with fewer layers,
its experts in MXFP4 as shipped.

gpt-oss-20b: hidden 2880, 64 heads of 64, 8 KV heads, q/k/v/o with biases, a sink per
head, 32 experts of width 2880 (4 a token) with biases, a router with a bias, sliding
windows of 128 on even layers and full attention on odd ones, YaRN (factor 32 over 4096
positions, base 150000), context 131072, vocabulary 201088, untied output; 24 layers in
the real model (default here: 4). Written as llama.cpp's converter writes it
(conversion/gpt_oss.py): experts split into ffn_{gate,up,down}_exps [experts, rows,
cols] in MXFP4 with their biases [experts, rows] in F32, attn_sinks.weight, the router
ffn_gate_inp, norms, biases and sinks in F32, and its metadata. Everything else is Q8_0
by default, as in ggml-org's gpt-oss-20b-mxfp4.gguf (file type MOSTLY_MXFP4_MOE,
whose 12.1 GB that mix accounts for); --other F16 or BF16 writes those in half
precision instead. The MXFP4 and Q8_0 tensors are random valid blocks with small
scales, not quantized floats: only the layout and sizes matter for speed.

No o200k_harmony vocabulary is at hand (llama.cpp ships no ggml-vocab for it), so the
vocabulary is a synthetic byte-level BPE one of the real size (gpt2 model, the gpt-4o
pre-tokenizer), each token past the 256 bytes the merge of two earlier ones, with
harmony's special tokens at their real ids (<|return|> 200002, <|channel|> 200005,
<|start|> 200006, <|end|> 200007, <|message|> 200008, <|call|> 200012, ...) and
gpt-oss's chat template where tests/data/fetch.py has fetched it. Tensors are streamed
to the file one at a time, so memory stays near one expert stack.

    python benchmarks/make_gpt_oss_model.py [--layers 4] [--other Q8_0] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, TokenType
from gguf import GGMLQuantizationType as T

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent / "tests/data/cache/templates/openai-gpt-oss-120b.jinja"
ARCH = "gpt-oss"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2880, 64, 8, 64
EXPERTS, USED, WIDTH, VOCAB_SIZE, REAL_LAYERS = 32, 4, 2880, 201088, 24
WINDOW, CONTEXT, ROPE_BASE, YARN_FACTOR, YARN_ORIGINAL = 128, 131072, 150000.0, 32.0, 4096
# o200k_harmony's special tokens (200000 up, the rest <|reserved_N|>).
SPECIAL = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>"}
SPECIAL |= {200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>"}
SPECIAL |= {200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>", 200018: "<|endofprompt|>"}
FIRST_SPECIAL = 199998
OTHER_TYPES = {"Q8_0": T.Q8_0, "F16": T.F16, "BF16": T.BF16}
Q8_SCALE = 2.5e-4  # weights of about 0.02


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character each byte is written as."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def add_vocabulary(writer: gguf.GGUFWriter, rng: np.random.Generator) -> None:
    tokens, merges, seen = byte_chars(), [], set()
    types = [TokenType.NORMAL] * 256
    while len(tokens) < FIRST_SPECIAL:
        # Each new token the merge of two earlier ones, so the merges are a real BPE's.
        a, b = rng.integers(0, len(tokens), 2)
        token = tokens[a] + tokens[b]
        if len(token) > 16 or token in seen:
            continue
        seen.add(token)
        tokens.append(token)
        merges.append(f"{tokens[a]} {tokens[b]}")
        types.append(TokenType.NORMAL)
    for i in range(FIRST_SPECIAL, VOCAB_SIZE):
        tokens.append(SPECIAL.get(i, f"<|reserved_{i}|>"))
        types.append(TokenType.CONTROL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(199998)
    writer.add_eos_token_id(200002)
    writer.add_pad_token_id(199999)
    if TEMPLATE.is_file():
        writer.add_chat_template(TEMPLATE.read_text())


def tensors(layers: int, other: T) -> list[tuple[str, tuple[int, ...], T]]:
    """(name, torch-order shape, type) of every tensor, in file order."""
    h, q, kv, e, w = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, EXPERTS, WIDTH
    f32 = T.F32
    out = [("token_embd.weight", (VOCAB_SIZE, h), other), ("output_norm.weight", (h,), f32)]
    out.append(("output.weight", (VOCAB_SIZE, h), other))
    for i in range(layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), f32), (p + "post_attention_norm.weight", (h,), f32)]
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h)):
            out += [(p + f"{name}.weight", (rows, cols), other), (p + f"{name}.bias", (rows,), f32)]
        out += [(p + "attn_output.weight", (h, q), other), (p + "attn_output.bias", (h,), f32)]
        out += [(p + "attn_sinks.weight", (HEADS,), f32)]
        out += [(p + "ffn_gate_inp.weight", (e, h), f32), (p + "ffn_gate_inp.bias", (e,), f32)]
        for name, rows, cols in (("gate", w, h), ("up", w, h), ("down", h, w)):
            out += [(p + f"ffn_{name}_exps.weight", (e, rows, cols), T.MXFP4)]
            out += [(p + f"ffn_{name}_exps.bias", (e, rows), f32)]
    return out


def random_data(name: str, dims: tuple[int, ...], qtype: T, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes: small random floats, ones for norms, random valid blocks."""
    if qtype == T.F32:
        if name.endswith("norm.weight"):
            return np.ones(dims, dtype=np.float32)
        scale = 1.0 if name.endswith("attn_sinks.weight") else 0.02
        return rng.standard_normal(dims, dtype=np.float32) * np.float32(scale)
    if qtype in (T.F16, T.BF16):
        data = rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)
        if qtype == T.F16:
            return data.astype(np.float16)
        return (data.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(dims)) // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == T.MXFP4:  # E8M0 scales 2^-8 .. 2^-6: weights up to 12 * 2^-6
        raw[:, 0] = rng.integers(128 - 8, 128 - 5, n_blocks, dtype=np.uint8)
    else:  # Q8_0: an f16 scale, then 32 int8
        scale = (rng.random(n_blocks, dtype=np.float32) + 0.5) * np.float32(Q8_SCALE)
        raw[:, :2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*dims[:-1], -1)


def write(path: Path, layers: int, other: T) -> None:
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name(
        f"gpt-oss-20b-shaped random MXFP4 experts, {other.name}, {layers} of {REAL_LAYERS} layers"
    )
    writer.add_block_count(layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(WIDTH)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(YARN_FACTOR)
    writer.add_rope_scaling_orig_ctx_len(YARN_ORIGINAL)
    writer.add_rope_scaling_yarn_beta_fast(32.0)
    writer.add_rope_scaling_yarn_beta_slow(1.0)
    writer.add_sliding_window(WINDOW)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(USED)
    writer.add_expert_feed_forward_length(WIDTH)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    rng = np.random.default_rng(0)
    add_vocabulary(writer, rng)
    plan = tensors(layers, other)
    for name, dims, qtype in plan:
        block, type_size = GGML_QUANT_SIZES[qtype]
        byte_shape = (*dims[:-1], dims[-1] // block * type_size)
        if qtype == T.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, qtype in plan:
        data = random_data(name, dims, qtype, rng)
        writer.write_tensor_data(data if qtype == T.F32 else data.view(np.uint8))
    writer.close()
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--other", choices=list(OTHER_TYPES), default="Q8_0")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpt-oss-20b-shaped-L{args.layers}-MXFP4-{args.other}.gguf"
    write(path, args.layers, OTHER_TYPES[args.other])


if __name__ == "__main__":
    main()
