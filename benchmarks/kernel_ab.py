"""Two builds of the native kernels side by side: the 8-bit-activation matvec
(llmrun_matvec_q8; with --exact the f32 one, llmrun_matvec) of each, called in turns on
the same weights, best of many calls.

On a VM whose speed drifts by 10-30 % within minutes, only kernels timed in turns in
one run can be compared. Build the old library by checking out the old sources and
loading llmrun.native once (its path: `python -c "from llmrun import native;
print(native.library()._name)"`); the new one the same way.

Usage: OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py OLD.so NEW.so
       [--types Q4_K,Q4_K:packed,Q6_K] [--rows 1] [--reps 30] [--exact] [--gemm 512]

warm: 256 rows x 4096 (in the L2 cache; a call's activation quantization counts);
cold: 40 matrices of 4096 x 4096 in turn (more than the L3 cache holds).
--gemm M: the prompt GEMM instead (llmrun_gemm_q8), M activation rows against a
Qwen2.5-0.5B feed-forward's 896 x 4864 and 4864 x 896 matrices, in GMAC/s; with one
thread timed on the thread's CPU clock, which the VM's other tenants cannot stretch.
"""

import argparse
import ctypes
import time

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from quant_matvec import random_blocks

from llmrun.quant import kernels

T = GGMLQuantizationType
COLS = 4096


def time_call(lib, type_id: int, mats: list[torch.Tensor], rows: int, x, y, exact: bool) -> float:
    call = lib.llmrun_matvec if exact else lib.llmrun_matvec_q8
    start = time.perf_counter()
    for w in mats:
        status = call(
            type_id, ctypes.c_void_p(w.data_ptr()), ctypes.c_int64(w.stride(0)),
            ctypes.c_int64(rows), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]),
            ctypes.c_int64(COLS), ctypes.c_void_p(y.data_ptr()), None,
        )  # fmt: skip
        if status:
            raise SystemExit("no such kernel for that type in a library")
    return (time.perf_counter() - start) / len(mats)


def gemm(libs: dict, types: list[str], m: int, reps: int) -> None:
    """--gemm: each type's prompt GEMM in both libraries, in turns, best of `reps`."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for name in types:
        type_name, _, layout = name.partition(":")
        ggml_type, packed = T[type_name], layout == "packed"
        for rows, cols in ((896, 4864), (4864, 896)):
            if cols % GGML_QUANT_SIZES[ggml_type][0]:
                continue
            raw = random_blocks(ggml_type, rows, cols)
            w = kernels.pack(raw, ggml_type) if packed else raw
            type_id = kernels.PACKED[ggml_type] if packed else int(ggml_type)
            x, y = torch.randn(m, cols), torch.empty(m, rows)
            best = dict.fromkeys(libs, float("inf"))
            for _ in range(reps):
                for key, lib in libs.items():
                    start = clock()
                    status = lib.llmrun_gemm_q8(
                        type_id, ctypes.c_void_p(w.data_ptr()), ctypes.c_int64(w.stride(0)),
                        ctypes.c_int64(rows), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(m),
                        ctypes.c_int64(cols), ctypes.c_void_p(y.data_ptr()), None,
                    )  # fmt: skip
                    best[key] = min(best[key], clock() - start)
                    if status:
                        raise SystemExit(f"no prompt GEMM for {name} in a library")
            rates = "  ".join(
                f"{k} {m * rows * cols / v / 1e9:6.1f} GMAC/s" for k, v in best.items()
            )
            print(f"{name:10} {rows}x{cols} m={m}: {rates}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--types", default="Q4_K,Q4_K:packed,Q5_K,Q6_K,Q8_0")
    parser.add_argument("--rows", type=int, default=1, help="activation rows per call")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--exact", action="store_true", help="the f32 kernels (llmrun_matvec)")
    parser.add_argument("--gemm", type=int, metavar="M", help="the prompt GEMM, M rows")
    args = parser.parse_args()
    libs = {"old": ctypes.CDLL(args.old), "new": ctypes.CDLL(args.new)}
    for lib in libs.values():  # the grid i-quants' kernels read gguf's tables
        if hasattr(lib, "llmrun_iq_tables"):
            lib.llmrun_iq_tables.argtypes = [ctypes.c_void_p] * 7
            kernels._iq_tables(lib)
    if args.gemm:
        gemm(libs, args.types.split(","), args.gemm, args.reps)
        return
    x = torch.randn(args.rows, COLS)
    for name in args.types.split(","):
        type_name, _, layout = name.partition(":")
        ggml_type, packed = T[type_name], layout == "packed"
        for label, rows, copies in (("warm", 256, 1), ("cold", 4096, 40)):
            raw = random_blocks(ggml_type, rows, COLS)
            w = kernels.pack(raw, ggml_type) if packed else raw
            mats = [w.clone() for _ in range(copies)]
            type_id = kernels.PACKED[ggml_type] if packed else int(ggml_type)
            y = torch.empty(args.rows, rows)
            best = dict.fromkeys(libs, float("inf"))
            for _ in range(args.reps):
                for key, lib in libs.items():
                    best[key] = min(
                        best[key], time_call(lib, type_id, mats, rows, x, y, args.exact)
                    )
            rates = "  ".join(f"{k} {w.numel() / v / 1e9:5.1f} GB/s" for k, v in best.items())
            print(f"{name:10} m={args.rows} {label}: {rates}", flush=True)


if __name__ == "__main__":
    main()
