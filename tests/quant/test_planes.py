"""The GPU layout (llmrun.quant.planes): planes dequantize bit for bit to gguf's numpy
reference, the fused product (eager and torch.compile'd, on CPU) equals the
reference weights' product to f32 rounding, and PlanarLinear's paths agree with it.
Run on CPU tensors: the ops are those the CUDA and MPS paths run."""

import shutil

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from test_quant_blocks import random_blocks

from llmrun.quant import planes
from llmrun.quant.planes import PlanarLinear

TYPES = sorted(planes.TYPES, key=lambda t: t.name)


def reference(raw: np.ndarray, ggml_type) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, ggml_type).astype(np.float32))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_planes_dequantize_exactly_as_gguf(ggml_type):
    raw = random_blocks(ggml_type, 8, 512, seed=3)
    split = planes.split(torch.from_numpy(raw), ggml_type)
    assert torch.equal(planes.dequantize(split, ggml_type), reference(raw, ggml_type))
    # About the bytes of the blocks (Q4_K: its 12 bytes of scales unpacked to 16).
    size = sum(p.nbytes for p in split.values())
    assert raw.nbytes <= size <= raw.nbytes * 148 // 144


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_the_fused_product_matches_the_reference_weights(ggml_type):
    raw = random_blocks(ggml_type, 24, 512, seed=4)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    expected = x.double() @ reference(raw, ggml_type).double().T
    got = planes.matvec(x, planes.split(torch.from_numpy(raw), ggml_type), ggml_type)
    assert got.dtype == torch.float32
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * scale)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on CPU generates C++ and needs a C++ compiler",
)
def test_the_compiled_product_equals_the_eager_one():
    """torch.compile's fused kernel (C++ on CPU; Triton on CUDA) for two types."""
    fused = PlanarLinear.compiled()
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1))
    for ggml_type in (planes.T.Q4_K, planes.T.Q8_0):
        split = planes.split(torch.from_numpy(random_blocks(ggml_type, 16, 512)), ggml_type)
        eager = planes.matvec(x, split, ggml_type)
        torch.testing.assert_close(fused(x, split, ggml_type), eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 12])
def test_planar_linear_takes_the_fused_product_for_few_rows_and_tiles_for_more(rows, monkeypatch):
    ggml_type = planes.T.Q6_K
    raw = random_blocks(ggml_type, 40, 256, seed=5)
    bias = torch.randn(40)
    calls = []

    def fused(x, split, t):
        calls.append(x.shape[0])
        return planes.matvec(x, split, t)

    monkeypatch.setattr(planes, "TILE_WEIGHTS", 256 * 16)  # three tiles, the last short
    layer = PlanarLinear(torch.from_numpy(raw), ggml_type, 256, bias, fused=fused)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ reference(raw, ggml_type).double().T + bias.double()
    got = layer(x[None])[0]
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * expected.abs().max())
    assert calls == ([1] if rows == 1 else [])
    # In the activations' dtype (bf16 on a GPU): the weights rounded to it, the sums too.
    half = layer(x.bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), expected, rtol=0, atol=3e-2 * expected.abs().max())


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_a_model_in_the_gpu_layout_gives_the_logits_of_gguf_dequantized_weights(name, tmp_path):
    """What the loader does on CUDA and MPS (planes.convert), here on CPU tensors: every
    quantized matrix (the tied head included) as planes, a prompt through
    tiles and F.linear, then decoding through the fused product, against the same
    weights dequantized by gguf and stored as F32."""
    from test_quant_models import assert_reassociation_close, random_block_model

    from llmrun.bench import weight_bytes_per_token
    from llmrun.loading.loader import load_model

    types = [planes.T.Q4_K, planes.T.Q6_K, planes.T.Q5_0, planes.T.Q8_0, planes.T.Q4_0]
    q, ref = random_block_model(name, types, tmp_path)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for path, convert in ((q, True), (ref, False)):
        model = load_model(path, torch.device("cpu"), "f32").model
        if convert:
            model.decode_step = None
            blocks = weight_bytes_per_token(model)
            assert planes.convert(model, planes.matvec) >= 7
            assert not any(type(m).__name__ == "QuantLinear" for m in model.modules())
            # bench's weights a token reads: the planes, about the blocks' bytes.
            assert blocks <= weight_bytes_per_token(model) <= blocks * 148 / 144
        cache = model.new_cache(1, 16, torch.float32, "cpu")
        with torch.no_grad():
            out = [model(ids[:, :6], torch.arange(6)[None], cache)[0]]
            for p in range(6, 9):
                out.append(model(ids[:, p : p + 1], torch.tensor([[p]]), cache)[0])
        results.append(torch.cat(out))
    assert_reassociation_close(*results)
