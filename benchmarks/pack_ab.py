"""Two builds of the native library's repacking (llmrun_pack, what a load does to each
weight tensor that has a packed layout) side by side, on a GGUF's own tensors.

Every packable tensor of MODEL is packed into memory faulted in beforehand, by each
library in turn, REPS times: so the times are the packing's alone (reading the mapped
file and writing the layout), not the first touch of the file's pages or of fresh
memory, which a load pays either way. Build the old library by checking out the old
sources and loading llmrun.native once (its path: `python -c "from llmrun import native;
print(native.library()._name)"`); the new one the same way.

Usage: python benchmarks/pack_ab.py MODEL.gguf OLD.so NEW.so [--reps 4]
"""

import argparse
import ctypes
import time

from gguf import GGML_QUANT_SIZES

from llmrun.loading.gguf_io import load_tensor, read_gguf
from llmrun.quant import hugepages, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    libs = {"old": ctypes.CDLL(args.old), "new": ctypes.CDLL(args.new)}
    for lib in libs.values():
        lib.llmrun_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
        lib.llmrun_pack.argtypes += [ctypes.c_int64, ctypes.c_void_p]
    gguf = read_gguf(args.model)
    tensors = [
        (load_tensor(gguf, info), info.ggml_type)
        for info in gguf.tensors.values()
        if info.ggml_type in kernels.PACKED
    ]
    outs = [hugepages.empty(raw.shape) for raw, _ in tensors]
    for (raw, _), out in zip(tensors, outs, strict=True):
        out.copy_(raw)  # every page of both in memory before the timing
    times: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(args.reps):
        for name, lib in libs.items():
            start = time.perf_counter()
            for (raw, ggml_type), out in zip(tensors, outs, strict=True):
                blocks = raw.shape[1] // GGML_QUANT_SIZES[ggml_type][1]
                lib.llmrun_pack(
                    int(ggml_type), raw.data_ptr(), raw.shape[0], blocks, out.data_ptr()
                )
            times[name].append(time.perf_counter() - start)
    gb = sum(raw.numel() for raw, _ in tensors) / 1e9
    print(f"{len(tensors)} tensors, {gb:.2f} GB")
    for name, runs in times.items():
        spread = " ".join(f"{t:.3f}" for t in runs)
        print(f"{name}: {spread} s (best {min(runs):.3f} s, {gb / min(runs):.1f} GB/s)")


if __name__ == "__main__":
    main()
