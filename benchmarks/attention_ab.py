"""Two builds of the native kernels side by side: single-query attention over a KV cache
(llmrun_attend_one_sinks, as a decode step runs it per layer) of each, called in turns
on the same keys and values, for each stored type; and whether the two give the same
output bit for bit.

Build each library as benchmarks/kernel_ab.py says (check out its sources, load
llmrun.native once, print native.library()._name).

Usage: python benchmarks/attention_ab.py OLD.so NEW.so [--length 4096] [--heads 14]
       [--kv-heads 2] [--dim 64] [--reps 60]

Defaults: Qwen2.5-0.5B's attention (14 query heads sharing 2 KV heads of 64) at a depth
of 4096 tokens, which reads 4 MB of f32 keys and values per call.
"""

import argparse
import ctypes
import statistics
import time

import torch

KINDS = {"f32": (0, torch.float32), "f16": (1, torch.float16), "bf16": (30, torch.bfloat16)}


def bind(path: str):
    call = ctypes.CDLL(path).llmrun_attend_one_sinks
    call.restype = ctypes.c_int
    call.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 5]
    call.argtypes += [ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    calls = {"old": bind(args.old), "new": bind(args.new)}
    torch.manual_seed(0)
    q = torch.randn(args.heads, args.dim)
    outputs = {name: torch.empty(args.heads * args.dim) for name in calls}
    scale = args.dim**-0.5
    for kind_name, (kind, dtype) in KINDS.items():
        shape = (args.kv_heads, args.length, args.dim)
        k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        head_bytes = args.length * args.dim * k.element_size()
        times = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(10):
                    failed = call(
                        kind, q.data_ptr(), k.data_ptr(), v.data_ptr(), args.heads,
                        args.kv_heads, args.length, args.dim, head_bytes, scale, 0.0, None,
                        outputs[name].data_ptr(),
                    )  # fmt: skip
                    assert not failed, f"{name} refused {kind_name}"
                times[name].append((time.perf_counter() - start) / 10 * 1e6)
        old, new = (statistics.median(times[name]) for name in calls)
        same = torch.equal(outputs["old"], outputs["new"])
        print(
            f"{kind_name:5} old {old:7.0f} us  new {new:7.0f} us  (medians of {args.reps}) "
            f"new/old speed {old / new:.2f}x  same output: {same}"
        )


if __name__ == "__main__":
    main()
