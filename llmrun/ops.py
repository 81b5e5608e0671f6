"""The small ops of a decode step, with a native CPU path: RMSNorm (Gemma's too), the
rotary embedding, the SiLU- and tanh-GELU-gated products and single-query attention
(soft-capped for Gemma 2, with attention sinks for gpt-oss) over a KV cache stored as
f32, f16, bf16 or Q8_0 blocks.

On one token's activations a torch op costs 2-40 us, mostly dispatch (more between
matvecs that stream the weights through the caches), and the ~45 of them per layer
came to ~8 ms of a ~28 ms token on a 24-layer 0.5B model. Where the native kernels
are built (llmrun.native) and the inputs are CPU f32, contiguous, without autograd
and at most NATIVE_MAX_VALUES values (decode, small batches), each op here is one C
call (llmrun/native/decode_ops.c). Otherwise (GPU, MPS, bf16, prefill) it is
the torch code beside it. The gated products take a prompt's rows natively too, one
pass over the OpenMP team where torch makes two (and a temporary). The two agree to
float rounding (tests/test_ops.py).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from llmrun import native

# Bigger inputs (prefill) go to torch, whose kernels use every thread.
NATIVE_MAX_VALUES = 1 << 16
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # values per block; bytes per block: f16 scale, 32 int8
# How decode_ops.c knows a KV cache's storage (GGML type ids); uint8 rows are Q8_0 blocks.
_KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.uint8: 8, torch.bfloat16: 30}


def _native(*tensors: torch.Tensor, most: int | None = NATIVE_MAX_VALUES) -> ctypes.CDLL | None:
    """The native library if every tensor can go to it (at most `most` values each;
    None: any number), else None."""
    for t in tensors:
        if (
            t.device.type != "cpu"
            or t.dtype != torch.float32
            or (t.requires_grad and torch.is_grad_enabled())
            or not t.is_contiguous()
            or (most is not None and t.numel() > most)
        ):
            return None
    return native.library()


def native_takes(*tensors: torch.Tensor) -> bool:
    """Whether the native ops can take these tensors, of any size (CPU f32, contiguous,
    without autograd, the native library built)."""
    return _native(*tensors, most=None) is not None


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
    lib = _native(gate, up, most=None) if gate.shape == up.shape else None
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
    lib = _native(gate, up, most=None) if gate.shape == up.shape else None
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


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a multiple of 32) as Q8_0 blocks, uint8 [..., D / 32 * 34]: per 32
    values an f16 scale d = max|x| / 127 (rounded to nearest even), then the int8
    x / d rounded half away from zero, bit for bit as gguf.quants.quantize (and
    ggml's quantize_row_q8_0_ref) writes them: the same f32 operations."""
    blocks = x.float().unflatten(-1, (-1, Q8_0_BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d == 0, 0.0, 1 / d)
    magnitude = scaled.abs()
    whole = magnitude.floor()
    q = torch.sign(scaled) * (whole + (2 * (magnitude - whole)).floor())  # gguf's np_roundf
    scales = d.to(torch.float16).view(torch.uint8)  # [..., blocks, 2]
    return torch.cat([scales, q.to(torch.int8).view(torch.uint8)], dim=-1).flatten(-2)


def dequantize_q8_0(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q8_0 rows uint8 [..., D / 32 * 34] (a view of a cache will do) -> [..., D] in
    `dtype`: d * q, exact in f32."""
    grouped = blocks.unflatten(-1, (-1, Q8_0_BYTES))
    scales = grouped[..., :2].contiguous().view(torch.float16).float()
    q = grouped[..., 2:].view(torch.int8).float()
    return (q * scales).flatten(-2).to(dtype)


def stored_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A KV cache's stored keys or values (float tensors, or uint8 Q8_0 rows) in `dtype`."""
    if x.dtype == torch.uint8:
        return dequantize_q8_0(x, dtype)
    return x if x.dtype == dtype else x.to(dtype)


def _stored_row(k: torch.Tensor, v: torch.Tensor, head_dim: int) -> int | None:
    """The length of a key's stored row (head_dim values, or Q8_0's bytes of them) where
    the native attention kernels read k and v as they are (a KV cache's f32, f16, bf16 or
    Q8_0, on the CPU, both of one type, rows of that length), else None."""
    row = head_dim // Q8_0_BLOCK * Q8_0_BYTES if k.dtype == torch.uint8 else head_dim
    if (
        k.dtype not in _KV_KINDS
        or k.dtype != v.dtype
        or k.shape[-1] != row
        or k.device.type != "cpu"
        or k.requires_grad
        or v.requires_grad
    ):
        return None
    return row


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per head, q [B, H, 1, D], over every key and value
    k/v [B, Hkv, L, D] (H a multiple of Hkv: grouped-query attention), the scores
    scaled by `scale` (default D^-0.5) and, with `softcap`, soft-capped to
    softcap * tanh(score / softcap) (Gemma 2); with `sinks` [H] (gpt-oss), each head's
    sink logit joins its softmax's denominator only. Returns [B, 1, H*D]. k and v may
    be as a KV cache stores them (f32, f16 or bf16 values, or uint8 [B, Hkv, L, D / 32 *
    34] Q8_0 rows): the native path reads them as they are, torch dequantizes."""
    batch, heads, _, head_dim = q.shape
    groups, length = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    kind, row = _KV_KINDS.get(k.dtype), _stored_row(k, v, head_dim)
    if (
        batch == 1
        and row is not None
        and head_dim % (Q8_0_BLOCK if kind == 8 else 16) == 0
        and k.stride() == v.stride()
        and k.stride(-1) == 1
        and k.stride(-2) == row
    ):
        lib = _native(q) if sinks is None else _native(q, sinks)
        if lib is not None:
            y = torch.empty(1, 1, heads * head_dim)
            if kind == 0 and sinks is None:
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
            args = (
                kind,
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                heads,
                groups,
                length,
                head_dim,
                k.stride(1) * k.element_size(),
                scale,
                softcap or 0.0,
            )
            if sinks is None:
                failed = lib.llmrun_attend_one_stored(*args, y.data_ptr())
            else:
                failed = lib.llmrun_attend_one_sinks(*args, sinks.data_ptr(), y.data_ptr())
            if not failed:
                return y
    k, v = stored_values(k, q.dtype), stored_values(v, q.dtype)
    # Grouped matmuls, so each KV head serves its query heads without being repeated.
    q = q.reshape(batch, groups, heads // groups, head_dim)
    if softcap is None:
        scores = (q * scale) @ k.transpose(-1, -2)
    else:
        scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        # The sink as one more score column, dropped after the softmax.
        sink = sinks.to(scores.dtype).view(1, groups, heads // groups, 1)
        logits = torch.cat([scores, sink.expand(batch, -1, -1, 1)], dim=-1)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :length]
    return (weights.to(v.dtype) @ v).view(batch, 1, heads * head_dim)


def attend_prompt(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float | None = None,
    softcap: float | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Causal attention of one sequence's prompt: q [1, H, T, D] at positions start ..
    start + T - 1 over k/v [1, Hkv, start + T, D] of positions 0 .. start + T - 1 (as a
    KV cache stores them, see attend_one), query t seeing keys up to its own position
    (with a sliding `window`, only the last `window` of them); scale, softcap and sinks
    [H] as attend_one's. Returns [1, T, H*D], or None where the native kernel cannot take
    them (the caller goes to torch)."""
    batch, heads, tokens, head_dim = q.shape
    kind, row = _KV_KINDS.get(k.dtype), _stored_row(k, v, head_dim)
    if (
        batch != 1
        or row is None
        or tuple(k.shape[:3]) != (1, k.shape[1], start + tokens)
        or heads % k.shape[1] != 0
        or k.shape != v.shape
        or (sinks is not None and tuple(sinks.shape) != (heads,))
    ):
        return None
    # A head's rows one after another (as a cache's buffer holds them; a forward without
    # one has its keys [B, T, Hkv, D] transposed), k's heads as far apart as v's
    if k.stride(-1) != 1 or k.stride(-2) != row:
        k = k.contiguous()
    if v.stride(-1) != 1 or v.stride(-2) != row or (k.shape[1] > 1 and v.stride(1) != k.stride(1)):
        k, v = k.contiguous(), v.contiguous()
    queries = q.transpose(1, 2).contiguous()  # [1, T, H, D]: a token's heads together
    lib = _native(queries, *([] if sinks is None else [sinks]), most=None)
    if lib is None:
        return None
    y = torch.empty(1, tokens, heads * head_dim)
    failed = lib.llmrun_attend_prompt(
        kind,
        queries.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        tokens,
        start,
        heads,
        k.shape[1],
        head_dim,
        k.stride(1) * k.element_size(),
        head_dim**-0.5 if scale is None else scale,
        softcap or 0.0,
        window,
        None if sinks is None else sinks.data_ptr(),
        y.data_ptr(),
    )
    return None if failed else y


def attend_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    first: int,
    length: int,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """attend_one for one sequence, q [1, H, 1, D], over keys first .. length - 1 of a
    paged cache: k/v one layer's pool [blocks, Hkv, block_rows, D] (as stored, see
    attend_one), position p in row p % block_rows of block table[p // block_rows]
    (table: int32 [>= blocks of length]). Returns [1, 1, H*D], or None where the
    native kernel cannot take it (the caller gathers the blocks for torch)."""
    heads, head_dim = q.shape[1], q.shape[3]
    kind = _KV_KINDS.get(k.dtype)
    lib = _native(q)
    if (
        lib is None
        or kind is None
        or k.device.type != "cpu"
        or k.dtype != v.dtype
        or not (k.is_contiguous() and v.is_contiguous() and table.is_contiguous())
        or table.dtype != torch.int32
        or table.numel() * k.shape[2] < length  # the native kernel reads entries to length
    ):
        return None
    y = torch.empty(1, 1, heads * head_dim)
    size = k.element_size()
    failed = lib.llmrun_attend_paged(
        kind,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        table.data_ptr(),
        k.shape[0],
        k.shape[2],
        k.stride(0) * size,
        first,
        length,
        heads,
        k.shape[1],
        head_dim,
        k.stride(1) * size,
        scale,
        softcap or 0.0,
        y.data_ptr(),
    )
    return None if failed else y


def gated_delta_step(
    mixed: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    counts: torch.Tensor,
    k_heads: int,
    tiled: bool,
    l2_eps: float,
    eps: float,
) -> torch.Tensor | None:
    """One token of a Gated DeltaNet layer for each of B rows, natively (decode_ops.c
    llmrun_gated_delta_step says what it computes): the projections mixed [B, 1,
    channels], a and b [B, 1, Hv], z [B, 1, Hv * Dv]; conv_state [B, channels, K - 1]
    and state [B, Hv, Dk, Dv] (f32), updated in place; conv_weight [channels, 1, K];
    counts [B] (int64, 0 for a padding row). Returns y [B, 1, Hv * Dv], or None where
    the native op cannot take them (the layer's torch code runs instead)."""
    tensors = (mixed, conv_state, conv_weight, a, b, neg_a, dt_bias, state, z, norm_weight)
    lib = _native(*tensors, most=None)
    if lib is None or counts.dtype != torch.int64 or not counts.is_contiguous():
        return None
    rows, _, v_heads, dk, dv = *mixed.shape[:2], *state.shape[1:]
    channels, kernel = conv_weight.shape[0], conv_weight.shape[-1]
    y = torch.empty(rows, 1, v_heads * dv)
    lib.llmrun_gated_delta_step(
        rows,
        counts.data_ptr(),
        mixed.data_ptr(),
        conv_state.data_ptr(),
        conv_weight.data_ptr(),
        channels,
        kernel,
        a.data_ptr(),
        b.data_ptr(),
        neg_a.data_ptr(),
        dt_bias.data_ptr(),
        state.data_ptr(),
        k_heads,
        v_heads,
        dk,
        dv,
        int(tiled),
        l2_eps,
        z.data_ptr(),
        norm_weight.data_ptr(),
        eps,
        y.data_ptr(),
    )
    return y
