"""The small ops of a decode step, with a native CPU path: RMSNorm (Gemma's too), the
rotary embedding, the SiLU- and tanh-GELU-gated products and single-query attention
(soft-capped for Gemma 2).

On one token's activations a torch op costs 2-40 us, mostly dispatch (more between
matvecs that stream the weights through the caches), and the ~45 of them per layer
came to ~8 ms of a ~28 ms token on a 24-layer 0.5B model. Where the native kernels
are built (llmrun.native) and the inputs are CPU f32, contiguous, without autograd
and at most NATIVE_MAX_VALUES values (decode, small batches), each op here is one C
call (llmrun/native/decode_ops.c). Otherwise (GPU, MPS, bf16, prefill) it is
the torch code beside it. The two agree to float rounding (tests/test_ops.py).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from llmrun import native

# Bigger inputs (prefill) go to torch, whose kernels use every thread.
NATIVE_MAX_VALUES = 1 << 16


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The native library if every tensor can go to it, else None."""
    for t in tensors:
        if (
            t.device.type != "cpu"
            or t.dtype != torch.float32
            or t.requires_grad
            or not t.is_contiguous()
            or t.numel() > NATIVE_MAX_VALUES
        ):
            return None
    return native.library()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * (weight + offset) (Gemma's: offset 1)."""
    lib = _native(x, weight)
    if lib is None:
        # One fused op; it accumulates in float32 whatever the input dtype.
        return F.rms_norm(x, (x.shape[-1],), weight + offset if offset else weight, eps)
    n = x.shape[-1]
    y = torch.empty_like(x)
    lib.llmrun_rms_norm_offset(
        x.data_ptr(), weight.data_ptr(), offset, eps, x.numel() // n, n, y.data_ptr()
    )
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of x [B, H, T, D] (half-split layout),
    with cos and sign-folded sin [B, 1, T, rotary_dim] in x's dtype: rotate_half(x) *
    sin == swap_halves(x) * cat(-sin, sin)."""
    rotary_dim = cos.shape[-1]
    lib = _native(x, cos, sin) if cos.numel() == rotary_dim else None
    if lib is not None:  # one position (decode): the same angles for every head
        y = torch.empty_like(x)
        dim = x.shape[-1]
        lib.llmrun_rotary(
            x.data_ptr(),
            x.numel() // dim,
            dim,
            cos.data_ptr(),
            sin.data_ptr(),
            rotary_dim,
            y.data_ptr(),
        )
        return y
    half = rotary_dim // 2
    if rotary_dim == x.shape[-1]:
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    swapped = torch.cat((x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + swapped * sin, x_pass), dim=-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    lib = _native(gate, up) if gate.shape == up.shape else None
    if lib is None:
        return F.silu(gate) * up
    y = torch.empty_like(gate)
    lib.llmrun_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), y.data_ptr())
    return y


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (transformers' gelu_pytorch_tanh)."""
    return F.gelu(x, approximate="tanh")


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, Gemma's GeGLU product."""
    lib = _native(gate, up) if gate.shape == up.shape else None
    if lib is None:
        return gelu_tanh(gate) * up
    y = torch.empty_like(gate)
    lib.llmrun_gelu_tanh_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), y.data_ptr())
    return y


def gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, the gated feed-forward's product (SiLU: silu_mul, tanh GELU:
    gelu_tanh_mul)."""
    if act is F.silu:
        return silu_mul(gate, up)
    if act is gelu_tanh:
        return gelu_tanh_mul(gate, up)
    return act(gate) * up


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query per head, q [B, H, 1, D], over every key and value
    k/v [B, Hkv, L, D] (H a multiple of Hkv: grouped-query attention), the scores
    scaled by `scale` (default D^-0.5) and, with `softcap`, soft-capped to
    softcap * tanh(score / softcap) (Gemma 2); returns [B, 1, H*D]."""
    batch, heads, _, head_dim = q.shape
    groups, length = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    if (
        batch == 1
        and head_dim % 16 == 0
        and k.stride() == v.stride()
        and k.stride(-1) == 1
        and k.stride(-2) == head_dim
        and k.device.type == "cpu"
        and k.dtype == v.dtype == torch.float32
        and not (k.requires_grad or v.requires_grad)
    ):
        lib = _native(q)
        if lib is not None:
            y = torch.empty(1, 1, heads * head_dim)
            lib.llmrun_attend_one_capped(
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                heads,
                groups,
                length,
                head_dim,
                k.stride(1),
                scale,
                softcap or 0.0,
                y.data_ptr(),
            )
            return y
    # Grouped matmuls, so each KV head serves its query heads without being repeated.
    q = q.reshape(batch, groups, heads // groups, head_dim)
    if softcap is None:
        scores = (q * scale) @ k.transpose(-1, -2)
    else:
        scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return (weights.to(v.dtype) @ v).view(batch, 1, heads * head_dim)
