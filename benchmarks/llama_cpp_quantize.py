"""`llmrun quantize` against llama.cpp's quantizer on a Qwen2.5-0.5B-shaped model (not
run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_quantize.py [--lcpp-python /tmp/lcpp/bin/python]
        [--presets Q4_K_M,Q8_0,...] [--threads N] [--out benchmarks/out]

Writes the random F16 model of make_qwen_model.py (hidden 896, 24 layers, GQA 7, tied
embeddings, the real Qwen2 vocabulary) once, then for each preset quantizes it with
llmrun.quantize and with llama_model_quantize of llama-cpp-python (a Python that has it,
e.g. /tmp/lcpp from the prebuilt wheel; run there in a subprocess, timed around the call),
both on --threads threads, and prints per preset: whether every tensor's type and bytes
are equal, whether the files are identical, and each one's wall time. Rows of 896 are not
whole K-blocks, so most tensors take llama.cpp's fallback types; ffn_down (rows of 4864)
and the output rules hold the K-quants.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

import make_qwen_model  # noqa: E402

from llmrun import quantize  # noqa: E402
from llmrun.loading.gguf_io import read_gguf  # noqa: E402
from llmrun.quant.presets import PRESETS, parse_preset  # noqa: E402

# Run by --lcpp-python: SRC DST FTYPE THREADS -> seconds of llama_model_quantize on stdout.
LLAMA_CPP = """
import sys, time, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), int(sys.argv[4])
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lcpp-python", default="/tmp/lcpp/bin/python")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    source = args.out / "qwen2.5-0.5b-shaped-F16.gguf"
    if not source.is_file():
        make_qwen_model.write(source, "F16")
    mine, theirs = args.out / "quantize-llmrun.gguf", args.out / "quantize-llama-cpp.gguf"
    print(f"{'preset':8} {'types':>9} {'bytes':>9} {'file':>9} {'llmrun s':>9} {'llama.cpp s':>12}")
    for name in args.presets.split(","):
        preset = parse_preset(name)
        start = time.perf_counter()
        quantize.quantize_file(source, mine, preset, threads=args.threads)
        ours = time.perf_counter() - start
        run = subprocess.run(
            [args.lcpp_python, "-c", LLAMA_CPP, source, theirs, str(int(preset.file_type)),
             str(args.threads)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
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
