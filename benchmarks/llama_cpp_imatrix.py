"""`llmrun imatrix` against llama.cpp's own graph (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_imatrix.py [--lcpp-python /tmp/lcpp/bin/python]
        [--chunk-size 32] [--repeats 12] [--out benchmarks/out]

llama-imatrix is not in the llama-cpp-python wheel, so its collection is redone here in
llama.cpp's graph: a subprocess on --lcpp-python builds a context with llama-imatrix's
settings (2048 // chunk-size sequences a batch, ubatches of 512, every logit kept) and
an eval callback (cb_eval) that does what tools/imatrix/imatrix.cpp's collect_imatrix
does on each MUL_MAT (a weight named blk.* or output.weight, 16 tokens or more, f32
activations) and MUL_MAT_ID (each routed token's row, per expert), over the same chunks
(the text tokenized whole, BOS first in each chunk). llmrun's imatrix runs on the same
GGUFs (the bundled stories260K, and F32 tiny random Llama and Qwen3-MoE with its
vocabulary), with --process-output. Printed per model: entries in both, counts equal, and the largest
difference of sums relative to the entry's largest sum (llama.cpp keeps the KV cache in
f16, so ~1e-3 is expected, not 0).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from helpers import STORIES_GGUF, STORY_PROMPTS, tiny_hf_model, write_gguf  # noqa: E402
from in_process import llmrun  # noqa: E402
from moe_helpers import (  # noqa: E402
    hub_state_dict,
    stacked_gguf_state,
    tiny_moe_model,
    write_moe_gguf,
)

from llmrun import imatrix  # noqa: E402

# Run by --lcpp-python: MODEL TEXT CHUNK_SIZE OUT.npz -> the sums and counts by name.
LLAMA_CPP = r"""
import ctypes, sys
from pathlib import Path
import numpy as np
import llama_cpp as L

model_path, text_path, n_ctx, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
base = ctypes.CDLL(str(Path(L.__file__).parent / "lib" / "libggml-base.so"))
base.ggml_op_name.restype, base.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
MUL_MAT = next(i for i in range(200) if base.ggml_op_name(i) == b"MUL_MAT")
MUL_MAT_ID = next(i for i in range(200) if base.ggml_op_name(i) == b"MUL_MAT_ID")
F32, I32 = 0, 26

class Tensor(ctypes.Structure):  # ggml.h's struct ggml_tensor
    pass
Tensor._fields_ = [
    ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
    ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32), ("src", ctypes.POINTER(Tensor) * 10),
    ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8),
]

def view(t, dtype):
    ne, nb = list(t.ne), list(t.nb)
    size = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(dtype).itemsize
    buf = (ctypes.c_char * size).from_address(t.data)
    return np.ndarray(ne[::-1], dtype, buf, strides=nb[::-1])  # [ne3, ne2, ne1, ne0]

sums, counts = {}, {}

def collect(address, ask, _):
    t = Tensor.from_address(address)
    if t.op not in (MUL_MAT, MUL_MAT_ID):
        return False
    src0, src1 = t.src[0].contents, t.src[1].contents
    name = src0.name.decode().split("#")[1] if b"#" in src0.name else src0.name.decode()
    if ask:
        if t.op == MUL_MAT_ID:
            return True
        if src1.ne[1] < 16 or src1.type != F32:
            return False
        return name.startswith("blk.") or name == "output.weight"
    x = view(src1, np.float32).astype(np.float64)
    if t.op == MUL_MAT_ID:
        ids = view(t.src[2].contents, np.int32)[0, 0]  # [n_tokens, n_ids]
        n_as = src0.ne[2]
        s = sums.setdefault(name, np.zeros((n_as, src1.ne[0])))
        c = counts.setdefault(name, np.zeros(n_as, np.int64))
        for row in range(ids.shape[0]):
            for idx in range(ids.shape[1]):
                ex = ids[row, idx]
                s[ex] += x[0, row, idx % src1.ne[1]] ** 2
                c[ex] += 1
    else:
        s = sums.setdefault(name, np.zeros((1, src1.ne[0])))
        c = counts.setdefault(name, np.zeros(1, np.int64))
        s[0] += (x.reshape(-1, src1.ne[0]) ** 2).sum(0)
        c[0] += x.size // src1.ne[0]
    return True

callback = L.ggml_backend_sched_eval_callback(collect)
L.llama_backend_init()
mparams = L.llama_model_default_params()
model = L.llama_model_load_from_file(model_path.encode(), mparams)
assert model, model_path
vocab = L.llama_model_get_vocab(model)
text = Path(text_path).read_bytes()
text = text[:-1] if text.endswith(b"\n") else text
tokens = (L.llama_token * (len(text) + 8))()
n = L.llama_tokenize(vocab, text, len(text), tokens, len(tokens), True, False)
tokens = list(tokens[:n])
n_seq = max(1, 2048 // n_ctx)
cparams = L.llama_context_default_params()
cparams.n_ctx, cparams.n_batch = n_seq * n_ctx, min(2048, n_seq * n_ctx)
cparams.n_ubatch, cparams.n_seq_max = min(512, cparams.n_batch), n_seq
cparams.cb_eval, cparams.cb_eval_user_data = callback, None
ctx = L.llama_init_from_model(model, cparams)
n_chunk = len(tokens) // n_ctx
bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else None
for i in range(0, n_chunk, n_seq):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    n_seqs = min(n_seq, n_chunk - i)
    batch = L.llama_batch_init(n_seqs * n_ctx, 0, 1)
    for s in range(n_seqs):
        chunk = tokens[(i + s) * n_ctx : (i + s + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        for k, token in enumerate(chunk):
            j = s * n_ctx + k
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, k, 1
            batch.seq_id[j][0], batch.logits[j] = s, True
    batch.n_tokens = n_seqs * n_ctx
    assert L.llama_decode(ctx, batch) == 0
    L.llama_batch_free(batch)
np.savez(out, **{f"{k}.sums": v for k, v in sums.items()}, **{f"{k}.counts": v for k, v in counts.items()})
"""


def models(out: Path) -> dict[str, Path]:
    hf, config = tiny_hf_model("llama")
    paths = {"stories260K": STORIES_GGUF}
    paths["llama"] = write_gguf(out / "model-llama-f32.gguf", config, hf.state_dict())
    hf, config = tiny_moe_model("qwen3_moe")
    state = stacked_gguf_state(hub_state_dict(hf, "qwen3_moe"), config)
    paths["qwen3_moe"] = write_moe_gguf(out / "model-qwen3moe-f32.gguf", config, state)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lcpp-python", default="/tmp/lcpp/bin/python")
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=12, help="the text: the stories x N")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    text = args.out / "imatrix-text.txt"
    text.write_text(" ".join(STORY_PROMPTS * args.repeats) + "\n")
    print(f"{'model':12} {'entries':>9} {'counts':>9} {'max rel. diff':>14}")
    for name, model in models(args.out).items():
        theirs = args.out / f"imatrix-{name}-llama-cpp.npz"
        subprocess.run(
            [args.lcpp_python, "-c", LLAMA_CPP, model, text, str(args.chunk_size), theirs],
            check=True, capture_output=True,
        )  # fmt: skip
        mine = args.out / f"imatrix-{name}.gguf"
        result = llmrun(
            "imatrix", model, "-f", text, "-c", args.chunk_size, "--process-output", "-o", mine
        )
        assert result.returncode == 0, result.stderr
        entries = imatrix.read(mine).entries
        peer = np.load(theirs)
        names = {k.rsplit(".", 1)[0] for k in peer.files}
        same_counts = sum(
            np.array_equal(entries[k].counts, peer[f"{k}.counts"]) for k in names & set(entries)
        )
        worst = max(
            np.abs(entries[k].sums - peer[f"{k}.sums"]).max() / np.abs(peer[f"{k}.sums"]).max()
            for k in names & set(entries)
        )
        both = f"{len(names & set(entries))}/{len(names | set(entries))}"
        print(f"{name:12} {both:>9} {same_counts:>4}/{len(names):<4} {worst:14.2e}")


if __name__ == "__main__":
    main()
