"""`llmrun quantize` against llama.cpp's quantizer on a Qwen2.5-0.5B-shaped model (not
run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_quantize.py [--lcpp-python /tmp/lcpp/bin/python]
        [--presets Q4_K_M,Q8_0,...] [--threads N] [--out benchmarks/out] [--imatrix]

Writes the random F16 model of make_qwen_model.py (hidden 896, 24 layers, GQA 7, tied
embeddings, the real Qwen2 vocabulary) once, then for each preset quantizes it with
llmrun.quantize and with llama_model_quantize of llama-cpp-python (a Python that has it,
e.g. /tmp/lcpp from the prebuilt wheel; run there in a subprocess, timed around the call),
both on --threads threads, and prints per preset: whether every tensor's type and bytes
are equal, whether the files are identical, and each one's wall time. Rows of 896 are not
whole K-blocks, so most tensors take llama.cpp's fallback types; ffn_down (rows of 4864)
and the output rules hold the K-quants and i-quants. The presets whose mix needs an
importance matrix (IQ1_S .. IQ3_XS, Q2_K_S) are refused without --imatrix: the row says
whether both refuse them.

With --imatrix, both quantize with the same importance matrix: seeded positive
importances for every matrix, written as an imatrix GGUF that llmrun reads as `llmrun
quantize --imatrix` does, given to llama_model_quantize as `params.imatrix` with the
quantize.imatrix.* entries llama-quantize adds as `params.kv_overrides`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

import make_qwen_model  # noqa: E402

from llmrun import imatrix, quantize  # noqa: E402
from llmrun.errors import UsageError  # noqa: E402
from llmrun.loading.gguf_io import read_gguf  # noqa: E402
from llmrun.quant.presets import PRESETS, parse_preset  # noqa: E402

# Run by --lcpp-python: SRC DST FTYPE THREADS [MEANS.npz METADATA.json] -> seconds of
# llama_model_quantize on stdout; MEANS: the importances by tensor name, METADATA: the
# (key, str or int) entries llama-quantize adds with them.
LLAMA_CPP = """
import ctypes, json, sys, time, llama_cpp
import numpy as np
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), int(sys.argv[4])
if len(sys.argv) > 5:
    means = {k: np.ascontiguousarray(v, np.float32) for k, v in np.load(sys.argv[5]).items()}
    rows = (llama_cpp.llama_model_imatrix_data * (len(means) + 1))()  # ends with name NULL
    for row, (name, values) in zip(rows, means.items()):
        row.name, row.size = name.encode(), values.size
        row.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    entries = json.loads(open(sys.argv[6]).read())
    kv = (llama_cpp.llama_model_kv_override * (len(entries) + 1))()  # ends with key ""
    for o, (key, value) in zip(kv, entries):
        o.key = key.encode()
        if isinstance(value, str):
            o.tag, o.value.val_str = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()
        else:
            o.tag, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, value
    params.imatrix, params.kv_overrides = rows, kv
start = time.perf_counter()
failed = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
print(time.perf_counter() - start)
sys.exit(failed)
"""


def compare(mine: Path, theirs: Path) -> tuple[int, int, int, bool]:
    """Tensors with equal types, with equal bytes, in all; whether the files are identical."""
    a, b = read_gguf(mine), read_gguf(theirs)
    same_type = same_bytes = 0
    for name, x in a.tensors.items():
        y = b.tensors.get(name)
        if y is None or x.ggml_type != y.ggml_type:
            continue
        same_type += 1
        left = np.frombuffer(a.buffer, np.uint8, x.nbytes, x.offset)
        same_bytes += np.array_equal(left, np.frombuffer(b.buffer, np.uint8, y.nbytes, y.offset))
    identical = mine.stat().st_size == theirs.stat().st_size and all(
        p == q for p, q in zip(_chunks(mine), _chunks(theirs), strict=True)
    )
    return same_type, same_bytes, len(a.tensors), identical


def _chunks(path: Path, size: int = 1 << 24):
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def seeded_imatrix(model: Path, path: Path) -> Path:
    """An imatrix GGUF of seeded importances (sums of one token) for every matrix."""
    rng = np.random.default_rng(0)
    entries = {}
    for info in read_gguf(model).tensors.values():
        if len(info.shape) >= 2:
            experts = info.shape[0] if len(info.shape) == 3 else 1
            sums = rng.uniform(0.05, 3, (experts, info.shape[-1])).astype(np.float32)
            entries[info.name] = imatrix.Entry(sums, np.ones(experts, np.int64))
    imatrix.write(imatrix.Imatrix(entries, ["seeded"], 1, 512), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lcpp-python", default="/tmp/lcpp/bin/python")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    parser.add_argument("--imatrix", action="store_true", help="with a seeded imatrix")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    source = args.out / "qwen2.5-0.5b-shaped-F16.gguf"
    if not source.is_file():
        make_qwen_model.write(source, "F16")
    mine, theirs = args.out / "quantize-llmrun.gguf", args.out / "quantize-llama-cpp.gguf"
    means, metadata, peer_args = None, [], []
    if args.imatrix:
        loaded = imatrix.read(seeded_imatrix(source, args.out / "imatrix-seeded.gguf"))
        means = loaded.means()
        metadata = imatrix.quantize_metadata(loaded, str(args.out / "imatrix-seeded.gguf"))
        np.savez(args.out / "imatrix-means.npz", **means)
        (args.out / "imatrix-metadata.json").write_text(json.dumps(metadata))
        peer_args = [args.out / "imatrix-means.npz", args.out / "imatrix-metadata.json"]
    print(f"{'preset':8} {'types':>9} {'bytes':>9} {'file':>9} {'llmrun s':>9} {'llama.cpp s':>12}")
    for name in args.presets.split(","):
        preset = parse_preset(name)
        start = time.perf_counter()
        try:
            quantize.quantize_file(
                source, mine, preset, threads=args.threads, imatrix=means, metadata=metadata
            )
            refused = False
        except UsageError:  # a mix that needs an importance matrix, without one
            refused = True
        ours = time.perf_counter() - start
        run = subprocess.run(
            [args.lcpp_python, "-c", LLAMA_CPP, source, theirs, str(int(preset.file_type)),
             str(args.threads), *peer_args],
            capture_output=True, text=True, check=not refused,
        )  # fmt: skip
        if refused:
            both = "both refuse it" if run.returncode else "ONLY llmrun refuses it"
            print(f"{preset.name:8} needs an imatrix: {both}")
            continue
        peer = float(run.stdout.split()[-1])
        types, same, total, identical = compare(mine, theirs)
        print(
            f"{preset.name:8} {types:>4}/{total:<4} {same:>4}/{total:<4} "
            f"{'identical' if identical else 'DIFFERS':>9} {ours:9.2f} {peer:12.2f}"
        )
    mine.unlink(missing_ok=True)
    theirs.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
