"""Quantized matrix-vector kernels: GB/s of weight bytes read for one token (M=1).

cold: cycles through --mb MB of matrices in Qwen2.5-1.5B's layer shapes (q, k, v, o,
gate, up, down; every width a multiple of 256, as K-quants need), more than the L3
cache holds, one call per matrix, as decoding does.
warm: one 8960 x 1536 matrix again and again (cache-resident; an upper bound).

kernels:
  native       llmrun's C kernels (llmrun/native/kernels_avx512.c, or kernels_avx2.c with
               LLMRUN_NATIVE=avx2 or on a CPU without AVX-512) on the GGUF blocks
  packed       the same on kernels.pack's layout (Q4_0, Q5_0, Q4_K, Q5_K), as QuantLinear uses it
  q8           the 8-bit-activation kernels (llmrun/native/q8.h; x quantized to Q8_0 per
               call, as in `--activations q8`) on the GGUF blocks (as experts keep them)
  q8-packed    the same on kernels.pack's layout, where the family has such a kernel for it
  torch        llmrun's pure-torch fallback: dequantize, then F.linear (no compiler)
  bf16-linear  torch F.linear on bf16 weights of the same shapes (torch's own dense path)

Each figure is the best of --reps passes (the median follows). On a shared machine,
--threads 1 --clock cpu times the calling thread's CPU time instead of the wall clock,
which other processes cannot inflate; with several threads, run where nothing else
runs: OpenMP teams that spin-wait (torch's and these kernels') collapse when another
busy process takes their cores (OMP_WAIT_POLICY=PASSIVE avoids that, at some cost in
latency on an idle machine).
Usage: python benchmarks/quant_matvec.py [--types F16,Q8_0,Q4_K,Q4_0] [--kernels native]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmrun import native
from llmrun.quant import kernels
from llmrun.quant.blocks import dequantize

T = GGMLQuantizationType
LAYER = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536)]
LAYER += [(1536, 8960)]
WARM = (8960, 1536)
# Offsets of f16 fields per block, set to finite values (random bytes may be inf/NaN).
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,)}
F16_FIELDS |= {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
F16_FIELDS |= {T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


def random_blocks(ggml_type: T, rows: int, cols: int) -> torch.Tensor:
    if ggml_type in (T.F32, T.F16, T.BF16):
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[ggml_type]
        return (torch.randn(rows, cols) * 0.02).to(dtype).view(torch.uint8)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = torch.randint(0, 256, (rows * cols // block_size, type_size), dtype=torch.uint8)
    scales = (torch.rand(raw.shape[0], 1) * 0.01).half().view(torch.uint8)
    for offset in F16_FIELDS.get(ggml_type, ()):
        raw[:, offset : offset + 2] = scales
    if ggml_type == T.MXFP4:  # E8M0 scales 2^-8 .. 2^-1
        raw[:, 0] = torch.randint(120, 128, (raw.shape[0],), dtype=torch.uint8)
    return raw.reshape(rows, -1)


def kernel(name: str, ggml_type: T) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if name == "native":
        return lambda w, x: kernels.matvec(w, ggml_type, x)
    if name == "packed":
        return lambda w, x: kernels.matvec(w, ggml_type, x, packed=True)
    if name in ("q8", "q8-packed"):
        packed = name == "q8-packed"
        return lambda w, x: kernels.matvec(w, ggml_type, x, packed=packed, q8=True)
    if name == "torch":
        return lambda w, x: F.linear(x, dequantize(w, ggml_type))
    if name == "bf16-linear":
        return F.linear
    raise SystemExit(f"unknown kernel {name}")


def cases(name: str, ggml_type: T, shapes: list[tuple[int, int]]) -> list[tuple]:
    """(weight, activation) pairs; activations are shared by shape, as in a model."""
    dtype = torch.bfloat16 if name == "bf16-linear" else torch.float32
    xs = {c: torch.randn(1, c, dtype=dtype) for c in {c for _, c in shapes}}
    if name == "bf16-linear":
        return [(torch.randn(r, c, dtype=dtype), xs[c]) for r, c in shapes]
    if name in ("packed", "q8-packed"):
        return [(kernels.pack(random_blocks(ggml_type, r, c), ggml_type), xs[c]) for r, c in shapes]
    return [(random_blocks(ggml_type, r, c), xs[c]) for r, c in shapes]


def measure(fn, pairs: list[tuple], reps: int, clock) -> list[float]:
    """GB/s of each of `reps` passes over all of `pairs`, one call per matrix."""
    nbytes = sum(w.numel() * w.element_size() for w, _ in pairs)
    results = []
    for _ in range(reps):
        start = clock()
        for w, x in pairs:
            fn(w, x)
        results.append(nbytes / (clock() - start) / 1e9)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="F16,Q8_0,Q4_K,Q4_0,Q6_K,Q5_0")
    parser.add_argument("--kernels", default="native,bf16-linear")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mb", type=int, default=800, help="cold working set, MB")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, {args.clock} clock, native: {native.status()}")
    print(f"{'type':8} {'kernel':12} {'cold best':>10} {'median':>8} {'warm best':>10}")
    runs = [(T[t], k) for t in args.types.split(",") for k in args.kernels.split(",")]
    # bf16-linear does not depend on the type: run it once.
    runs = [
        r for i, r in enumerate(runs) if r[1] != "bf16-linear" or i < len(args.kernels.split(","))
    ]
    runs = [r for r in runs if r[1] not in ("packed", "q8-packed") or _packs(r[0])]
    runs = [r for r in runs if r[1] != "q8" or kernels.supports_q8(r[0], WARM[1])]
    runs = [r for r in runs if r[1] != "q8-packed" or kernels.supports_q8(r[0], WARM[1], True)]
    for ggml_type, kname in runs:
        fn = kernel(kname, ggml_type)
        per_weight = 2 if kname == "bf16-linear" else _bytes_per_weight(ggml_type)
        layers = int(args.mb * 1e6 / (sum(r * c for r, c in LAYER) * per_weight)) + 1
        reps = args.reps if kname != "torch" else 2
        cold = measure(fn, cases(kname, ggml_type, LAYER * layers), reps, clock)
        warm = measure(fn, cases(kname, ggml_type, [WARM]) * 50, reps, clock)
        label = "(bf16)" if kname == "bf16-linear" else ggml_type.name
        print(
            f"{label:8} {kname:12} {max(cold):10.1f} {statistics.median(cold):8.1f} "
            f"{max(warm):10.1f}",
            flush=True,
        )


def _packs(ggml_type: T) -> bool:
    """Whether QuantLinear repacks this type's rows (of the shapes here) for this family."""
    return ggml_type in kernels.PACKED and kernels.supports(ggml_type, WARM[1], packed=True)


def _bytes_per_weight(ggml_type: T) -> float:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return type_size / block_size


if __name__ == "__main__":
    main()
