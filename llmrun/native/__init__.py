"""The native C library (CPU kernels), as callers see it: built at first use, its C API
declared for ctypes, and whether it is in use (and if not, why).

One kernel family is built, by the CPU's features (build.py): AVX-512
(kernels_avx512.c, with -march=native) or, on CPUs without it (most AMD Zen 2/3,
Intel desktop and laptop CPUs), AVX2 with FMA and F16C (kernels_avx2.c, with
-march=haswell). Both take the same GGML types and dequantize them exactly, and both
have the packed layouts of Q4_0 and Q5_0 (those of Q4_K and Q5_K only AVX-512: the
AVX2 library's llmrun_block is 0 for them); llmrun.quant.kernels binds those types.
Each family's library also holds decode_ops.c, the small ops of llmrun.ops.
LLMRUN_NATIVE=avx2 builds the AVX2 kernels on any CPU with AVX2 (to test them on an
AVX-512 machine). On 64-bit ARM the NEON family (kernels_neon.c, -march=armv8-a) has the
same types in the GGML layout only, and not the i-quants below IQ4 nor the ternary types
(iquants.h: x86 only), which torch code dequantizes there (tested under
qemu-user; speed unmeasured). Where
there is no compiler, the CPU has no family, the build fails,
or LLMRUN_NATIVE=0 is set, `available()` is False and callers use their torch code.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil

from llmrun.native import build

_reason = ""
_family = ""  # the kernel family loaded, once _library() has found one

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# The library's C API (common.h, decode_ops.c): argument types, and which return nothing.
_API = {
    "llmrun_block": [ctypes.c_int],
    "llmrun_matvec": [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR],
    "llmrun_matvec_experts": [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64],
    "llmrun_dequantize": [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR],
    "llmrun_pack": [ctypes.c_int, _PTR, _I64, _I64, _PTR],
    "llmrun_rms_norm": [_PTR, _PTR, _F32, _I64, _I64, _PTR],
    "llmrun_rms_norm_offset": [_PTR, _PTR, _F32, _F32, _I64, _I64, _PTR],
    "llmrun_rotary": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR],
    "llmrun_silu_mul": [_PTR, _PTR, _I64, _PTR],
    "llmrun_gelu_tanh_mul": [_PTR, _PTR, _I64, _PTR],
    "llmrun_attend_one": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _PTR],
    "llmrun_attend_one_capped": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _PTR],
    # the cache's storage type (decode_ops.c KV_*) first, head_stride in bytes
    "llmrun_attend_one_stored": [_INT, _PTR, _PTR, _PTR, *[_I64] * 5, _F32, _F32, _PTR],
    # as llmrun_attend_one_stored, with the per-head sink logits (f32) before y
    "llmrun_attend_one_sinks": [_INT, _PTR, _PTR, _PTR, *[_I64] * 5, _F32, _F32, _PTR, _PTR],
    # a prompt's queries [T, H, D] at positions start .. start + T - 1, causal; then
    # the window (0: none) and the sinks (NULL: none)
    "llmrun_attend_prompt": [_INT, _PTR, _PTR, _PTR, *[_I64] * 6, _F32, _F32, _I64, _PTR, _PTR],
    # kind, q, k and v pools, the block table (int32), then sizes as named in decode_ops.c
    "llmrun_attend_paged": [_INT, _PTR, _PTR, _PTR, _PTR, *[_I64] * 9, _F32, _F32, _PTR],
    # rows, counts (int64), then the tensors and sizes as named in decode_ops.c
    "llmrun_gated_delta_step": [
        _I64,
        _PTR,
        _PTR,
        _PTR,
        _PTR,
        _I64,
        _I64,
        *[_PTR] * 5,
        *[_I64] * 4,
        _INT,
        _F32,
        _PTR,
        _PTR,
        _F32,
        _PTR,
    ],
    # the layers (decode_step.c step_layer_t[]), the step (step_t), x; returns the
    # layers it ran, or -1
    "llmrun_decode_layers": [_PTR, _PTR, _PTR],
    # type, f32 rows, out, rows, row length, importance row (or NULL), threads (quantize.c);
    # returns bytes or -1
    "llmrun_quantize": [_INT, _PTR, _PTR, _I64, _I64, _PTR, _INT],
    # the same for the i-quant and ternary types (quantize_iq.c), and the kgrid tables
    # of their lattices, handed over by llmrun.quant.quantize_iq before any use
    "llmrun_quantize_iq": [_INT, _PTR, _PTR, _I64, _I64, _PTR, _INT],
    "llmrun_quantize_iq_grids": [_PTR] * 6,
}
# The 8-bit-activation kernels (q8.h), in the x86 families only.
_Q8_API = {
    "llmrun_q8_block": [ctypes.c_int],
    "llmrun_matvec_q8": [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR],
    "llmrun_matvec_experts_q8": [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64],
    # a prompt's rows on tiles of weights (-1 for a type or row length it cannot take)
    "llmrun_gemm_q8": [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR],
}
# The AVX2 family's f32 GEMM (gemm_avx2.c): as llmrun_matvec, for a prompt's many rows
# (-1 for a type it cannot take); elsewhere torch's GEMM takes them.
_GEMM_API = {"llmrun_gemm_f32": [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR]}
# Where the family has the i-quants (llmrun/native/iquants.h, the x86 families): their
# grids and sign table, handed over by llmrun.quant.kernels before any use.
_IQ_API = {"llmrun_iq_tables": [_PTR] * 7}
_VOID = (
    "llmrun_rms_norm",
    "llmrun_rms_norm_offset",
    "llmrun_rotary",
    "llmrun_silu_mul",
    "llmrun_gelu_tanh_mul",
    "llmrun_attend_one",
    "llmrun_attend_one_capped",
    "llmrun_gated_delta_step",
    "llmrun_quantize_iq_grids",
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _reason, _family
    _family = ""
    setting = os.environ.get("LLMRUN_NATIVE", "1")
    if setting == "0":
        _reason = "disabled by LLMRUN_NATIVE=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        _reason = "no C compiler found (set CC)"
        return None
    families, _reason = build.candidates(setting)
    # The next family down where a build fails (say, a compiler without AVX-512).
    for family in families:
        try:
            lib = build.load(compiler, family)
        except build.BuildError as e:
            _reason = str(e)
            continue
        break
    else:
        return None
    _family = family
    for name, argtypes in _API.items():
        getattr(lib, name).argtypes = argtypes
    for name, argtypes in {**_Q8_API, **_IQ_API, **_GEMM_API}.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
    if hasattr(lib, "llmrun_iq_tables"):
        lib.llmrun_iq_tables.restype = None
    for name in _VOID:
        getattr(lib, name).restype = None
    lib.llmrun_quantize.restype = _I64
    lib.llmrun_quantize_iq.restype = _I64
    return lib


# The tokenizer's library (tokenize.c): the vocabulary, its merges, and the two encoders.
_TOKENIZE_API = {
    "llmrun_vocab_new": ([_PTR, _I64, _PTR, _PTR, _I64, ctypes.c_int32, _PTR], _PTR),
    "llmrun_vocab_merges": ([_PTR, _PTR, _I64, _PTR, _I64], _I64),
    "llmrun_vocab_free": ([_PTR], None),
    "llmrun_bpe_encode": ([_PTR, _PTR, _I64, _PTR, _I64, _INT, _PTR], _I64),
    "llmrun_spm_encode": ([_PTR, _PTR, _I64, ctypes.c_int32, _PTR], _I64),
    "llmrun_gguf_strings": ([_PTR, _I64, _I64, _I64, _PTR], _I64),
}


@functools.cache
def tokenize_library() -> ctypes.CDLL | None:
    """The tokenizer's merging library (llmrun.gguf_bpe; it also finds the strings of a GGUF
    string array for llmrun.loading.gguf_io), or None where there is no C compiler, it fails
    to build, or LLMRUN_NATIVE=0 is set (the tokenizers library merges then)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if os.environ.get("LLMRUN_NATIVE", "1") == "0" or compiler is None:
        return None
    try:
        lib = build.load_tokenize(compiler)
    except build.BuildError:
        return None
    for name, (argtypes, restype) in _TOKENIZE_API.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library (None without native kernels), for other modules' bindings."""
    return _library()


def available() -> bool:
    """Whether the native kernels are built and usable on this machine."""
    return _library() is not None


def kernels() -> str | None:
    """The kernel family in use ("AVX-512", "AVX2" or "NEON"), or None without native kernels."""
    return _family if available() else None


def status() -> str:
    """'native (AVX-512)', 'native (AVX2)' or why the torch fallback is in use, for
    stats lines and bug reports."""
    return f"native ({kernels()})" if available() else f"torch fallback: {_reason}"
