"""QuantLinear and QuantEmbedding against f32 math on gguf's dequantized weights."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_quant_blocks import random_blocks
from torch import nn

from llmrun import native
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.quant import kernels, linear
from llmrun.quant.linear import QuantEmbedding, QuantLinear

T = GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
TYPES += [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
TYPES += [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0]
# The packed layouts each x86 kernel family has.
FAMILY_PACKED = {"AVX-512": [T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K], "AVX2": [T.Q4_0, T.Q5_0, T.Q8_0]}


@pytest.fixture(params=["AVX-512", "AVX2", "torch"])
def path(request, monkeypatch, use_kernels) -> str:
    """Run a test with each native kernel family (conftest.py) and again with the
    pure-torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "supports", lambda ggml_type, n_cols, packed=False: False)
    else:
        use_kernels(request.param)
    return request.param


def finite_blocks(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks; for the float types, random normal weights instead of random bytes."""
    if ggml_type in (T.F32, T.F16, T.BF16):
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[ggml_type]
        return w.to(dtype).view(torch.uint8).numpy()
    return random_blocks(ggml_type, rows, cols, seed)


def reference(raw: np.ndarray, ggml_type: T) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, ggml_type).astype(np.float32))


def assert_close_matmul(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Equal to f32 x @ w.T up to summation order: error bounded by ~n*eps*sum|x*w|."""
    expected = x.double() @ w.double().T
    bound = x.shape[-1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    assert torch.all((got.double() - expected).abs() <= bound + 1e-30)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [(1,), (2, 5)])
def test_quant_linear_matches_f32_matmul(ggml_type: T, batch: tuple[int, ...], path: str):
    raw = finite_blocks(ggml_type, 48, 512, seed=1)
    lin = QuantLinear(torch.from_numpy(raw), ggml_type, 512)
    assert (lin.in_features, lin.out_features, lin.ggml_type) == (512, 48, ggml_type)
    x = torch.randn(*batch, 512, generator=torch.Generator().manual_seed(2))
    y = lin(x)
    assert y.shape == (*batch, 48) and y.dtype == torch.float32
    assert_close_matmul(y, x, reference(raw, ggml_type))


@pytest.mark.parametrize("tile_weights", [1 << 22, 1000])
def test_quant_linear_gemm_path_and_tiles(tile_weights: int, path: str, monkeypatch):
    monkeypatch.setattr(linear, "TILE_WEIGHTS", tile_weights)
    raw = random_blocks(T.Q5_K, 40, 512, seed=8)
    lin = QuantLinear(torch.from_numpy(raw), T.Q5_K, 512)
    x = torch.randn(linear.MATVEC_MAX_ROWS + 3, 512, generator=torch.Generator().manual_seed(9))
    assert_close_matmul(lin(x), x, reference(raw, T.Q5_K))


@pytest.mark.parametrize("ggml_type", [T.F16, T.F32, T.BF16], ids=lambda t: t.name)
def test_float_rows_of_any_length(ggml_type: T):
    raw = finite_blocks(ggml_type, 5, 37, seed=10)
    lin = QuantLinear(torch.from_numpy(raw), ggml_type, 37)
    x = torch.randn(2, 37)
    assert_close_matmul(lin(x), x, reference(raw, ggml_type))


def test_quant_linear_bias_and_dtype(path: str):
    raw = random_blocks(T.Q4_K, 16, 256, seed=4)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(16, generator=gen)
    lin = QuantLinear(torch.from_numpy(raw), T.Q4_K, 256, bias=bias)
    x = torch.randn(3, 256, generator=gen)
    assert_close_matmul(lin(x) - bias, x, reference(raw, T.Q4_K))
    # bf16 in, bf16 out: the f32 result rounded once (half a bf16 ulp, at most 2**-8 relative).
    xb = x.to(torch.bfloat16)
    y = lin(xb)
    assert y.dtype == torch.bfloat16
    expected = xb.double() @ reference(raw, T.Q4_K).double().T + bias.double()
    assert torch.all((y.double() - expected).abs() <= 2.0**-8 * expected.abs() + 1e-3)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
def test_bias_is_added_in_every_layout_and_follows_the_module(ggml_type: T, path: str):
    # The native matvec adds the bias itself and binds it once; moving or replacing the
    # bias (.to(), load_state_dict(assign=True)) must bind again.
    raw = random_blocks(ggml_type, 24, 1024, seed=6)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(24, generator=gen)
    lin = QuantLinear(torch.from_numpy(raw), ggml_type, 1024, bias=bias.clone())
    # Each family packs Q4_0 and Q5_0, AVX2 Q8_0 as well (the torch path reads them too).
    packable = ggml_type != T.Q8_0 or path == "AVX2"
    assert lin.packed == (path != "torch" and packable)
    x = torch.randn(1, 1024, generator=gen)
    w = reference(raw, ggml_type)
    assert_close_matmul(lin(x) - bias, x, w)
    lin.to(torch.bfloat16)
    assert lin.bias.dtype == torch.bfloat16
    assert_close_matmul(lin(x) - lin.bias.float(), x, w)
    lin.float()
    new_bias = torch.randn(24, generator=gen)
    lin.load_state_dict({"weight": lin.weight, "bias": new_bias}, assign=True)
    assert_close_matmul(lin(x) - new_bias, x, w)


def test_quant_linear_keeps_the_raw_tensor_without_copy():
    raw = torch.from_numpy(random_blocks(T.Q4_1, 8, 64))  # no packed layout
    lin = QuantLinear(raw, T.Q4_1, 64)
    assert lin.weight.data_ptr() == raw.data_ptr()
    assert not lin.weight.requires_grad


def test_quant_embedding_dequantizes_the_rows_looked_up(path: str):
    raw = random_blocks(T.Q6_K, 50, 256, seed=6)
    emb = QuantEmbedding(torch.from_numpy(raw), T.Q6_K, 256)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    out = emb(ids)
    assert out.shape == (2, 3, 256) and out.dtype == torch.float32
    assert torch.equal(out, reference(raw, T.Q6_K)[ids])
    emb16 = QuantEmbedding(torch.from_numpy(raw), T.Q6_K, 256, compute_dtype=torch.bfloat16)
    assert emb16(ids).dtype == torch.bfloat16


@pytest.mark.parametrize("ggml_type", list(kernels.PACKED), ids=lambda t: t.name)
def test_pack_and_unpack_are_inverse(ggml_type: T):
    raw = torch.from_numpy(random_blocks(ggml_type, 6, 8 * GGML_QUANT_SIZES[ggml_type][0], seed=14))
    packed = kernels.pack(raw, ggml_type)
    type_size = raw.shape[1] // 8
    assert packed.shape == raw.shape and not torch.equal(packed, raw)
    assert torch.equal(packed[:, :16], raw.reshape(6, 8, type_size)[:, :, :2].reshape(6, 16))
    assert torch.equal(kernels.unpack(packed, ggml_type), raw)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [1, 2, 3, 16, 17, 35])
def test_k_quant_packing_interleaves_the_scale_fields_by_16_blocks(blocks: int, ggml_type: T):
    raw = torch.from_numpy(random_blocks(ggml_type, 3, 256 * blocks, seed=blocks))
    packed = kernels.pack(raw, ggml_type)
    assert torch.equal(kernels.unpack(packed, ggml_type), raw)
    scales = raw.reshape(3, blocks, -1)[:, :, 4:16]
    field = packed[:, 4 * blocks : 16 * blocks]
    for b in range(blocks):
        first = b - b % 16  # of the block's group, of `count` blocks
        count = min(16, blocks - first)
        for j in range(12):
            assert torch.equal(field[:, 12 * first + count * j + b - first], scales[:, b, j])


def test_q5_k_packing_turns_the_high_bits_into_masks_of_16_weights():
    raw = torch.from_numpy(random_blocks(T.Q5_K, 2, 512, seed=18))
    qh = raw.reshape(2, 2, 176)[:, :, 16:48]
    masks = kernels.pack(raw, T.Q5_K)[:, 32:96].reshape(2, 2, 32)
    for k in range(16):  # mask k: weights 16(k % 2)..16(k % 2) + 15 of sub-block k // 2
        for i in range(16):
            bit = masks[:, :, 2 * k + i // 8] >> (i % 8) & 1
            assert torch.equal(bit, qh[:, :, 16 * (k % 2) + i] >> (k // 2) & 1)


@pytest.mark.parametrize("ggml_type", list(kernels.PACKED), ids=lambda t: t.name)
def test_packed_weights_work_without_the_kernels(ggml_type: T, monkeypatch):
    raw = random_blocks(ggml_type, 24, 512, seed=15)
    lin = QuantLinear(torch.from_numpy(raw), ggml_type, 512)
    assert lin.packed == kernels.supports(ggml_type, 512, packed=True)
    # As after .to("cuda"): the torch path must read the packed layout.
    monkeypatch.setattr(kernels, "supports", lambda ggml_type, n_cols, packed=False: False)
    x = torch.randn(3, 512)
    assert_close_matmul(lin(x), x, reference(raw, ggml_type))


def test_tied_embedding_and_lm_head_share_one_tensor_through_to(monkeypatch):
    monkeypatch.setattr(kernels, "supports", lambda ggml_type, n_cols, packed=False: False)
    raw = torch.from_numpy(random_blocks(T.Q4_0, 40, 64))
    embed = QuantEmbedding(raw, T.Q4_0, 64)
    model = nn.ModuleDict({"embed": embed, "head": linear.tied_head(embed)})
    assert model["head"].weight.data_ptr() == raw.data_ptr() and not model["head"].packed
    # What .to("cuda") does to each tensor (.to("meta") swaps whole Parameters instead).
    model._apply(lambda t: t.clone())
    assert model["head"].weight is model["embed"].weight
    assert model["head"].weight.data_ptr() != raw.data_ptr()


@pytest.mark.parametrize("ggml_type", list(kernels.PACKED), ids=lambda t: t.name)
def test_tied_head_packs_the_embedding_where_the_kernels_can(native_kernels, ggml_type: T):
    raw = random_blocks(ggml_type, 40, 256, seed=16)
    embed = QuantEmbedding(torch.from_numpy(raw), ggml_type, 256)
    head = linear.tied_head(embed)
    assert head.weight is embed.weight
    # AVX2 has no packed Q4_K or Q5_K kernel, AVX-512 none for Q8_0.
    packable = ggml_type in FAMILY_PACKED[native_kernels]
    assert head.packed == embed.packed == packable
    x = torch.randn(2, 256)
    assert_close_matmul(head(x), x, reference(raw, ggml_type))
    ids = torch.tensor([[0, 39, 5]])
    assert torch.equal(embed(ids), reference(raw, ggml_type)[ids])
    model = nn.ModuleDict({"embed": embed, "head": head})
    model._apply(lambda t: t.clone())
    assert model["head"].weight is model["embed"].weight


def test_packed_embedding_works_without_the_kernels(monkeypatch):
    raw = random_blocks(T.Q4_0, 40, 256, seed=17)
    embed = QuantEmbedding(torch.from_numpy(raw), T.Q4_0, 256)
    if not linear.tied_head(embed).packed:
        pytest.skip(f"no packed layout without native kernels: {native.status()}")
    # As after .to("cuda"): lookups must read the packed layout in torch.
    monkeypatch.setattr(kernels, "supports", lambda ggml_type, n_cols, packed=False: False)
    ids = torch.tensor([[1, 38, 1]])
    assert torch.equal(embed(ids), reference(raw, T.Q4_0)[ids])


def test_wrong_byte_size_is_a_format_error():
    raw = torch.from_numpy(random_blocks(T.Q4_K, 4, 512))
    with pytest.raises(ModelFormatError, match=r"Q4_K.*\[rows, 144\].*\[4, 288\]"):
        QuantLinear(raw, T.Q4_K, 256)
    with pytest.raises(ModelFormatError, match="Q4_K"):
        QuantEmbedding(raw.reshape(-1), T.Q4_K, 512)
    with pytest.raises(ModelFormatError, match="whole number"):
        QuantLinear(raw, T.Q4_K, 300)
    with pytest.raises(ModelFormatError, match="bias"):
        QuantLinear(raw, T.Q4_K, 512, bias=torch.zeros(5))


def test_unsupported_type_is_refused():
    with pytest.raises(UnsupportedError, match="Q8_K"):
        QuantLinear(torch.zeros(2, 292, dtype=torch.uint8), T.Q8_K, 256)
