"""Whole models in every GGML type: GGUF files load and give the logits their
weights imply.

- Exact: a model whose weights are random blocks of a type gives the logits of
  the same model written as F32 with those blocks dequantized by gguf's numpy
  code (the independent reference), to float reassociation accuracy:
  max |difference| <= 1e-4 x max |logit|.
- Both run with the default kernels and again with the AVX2 kernels (conftest.py).
- Quantization error: an F32 model and its quantized copies differ by what the
  type's weight error predicts. To first order a relative weight error r (RMS over
  all matrices) moves the logits by a small multiple of r relative to their RMS;
  the bound allows 3r. Measured on this model (r, logit shift, ratio): Q8_0 0.005,
  0.009, 1.6; Q6_K 0.019, 0.031, 1.6; Q5_1 0.038, 0.059, 1.6; Q5_0 0.043, 0.070,
  1.7; Q4_K 0.078, 0.123, 1.6; Q4_1 0.078, 0.119, 1.5; Q4_0 0.086, 0.137, 1.6.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers import write_gguf
from test_quant_blocks import SCALED_TYPES, write_scales

from llmrun import native
from llmrun.loading.loader import load_model

T = GGMLQuantizationType
# Every width a multiple of 256, as K-quants need.
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
IDS = torch.tensor([[1, 17, 99, 200, 5, 42, 255, 3, 77, 128]])
CPU = torch.device("cpu")


@pytest.fixture(params=["default", "AVX2"], autouse=True)
def kernels(request, use_kernels) -> None:
    """Run each test with the default kernels (AVX-512 where the CPU has it, or the
    torch code without native kernels) and again with the AVX2 kernels."""
    if request.param == "AVX2":
        if native.kernels() == "AVX2":
            pytest.skip("the default kernels are the AVX2 kernels")
        use_kernels("AVX2")


def model(name: str):
    import transformers
    from helpers import BASE, CONFIGS

    config = transformers.AutoConfig.for_model(**{**BASE, **CONFIGS[name], **SHAPE})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    return hf, config.to_dict()


def logits(path) -> torch.Tensor:
    with torch.no_grad():
        return load_model(path, CPU, "f32").model(IDS, torch.arange(IDS.shape[1])[None])


def blocks(ggml_type: T, rows: int, cols: int, rng) -> np.ndarray:
    """Random valid blocks with small scales, so the weights look like a model's."""
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    write_scales(raw, ggml_type, lambda n: np.abs(rng.standard_normal(n)) * 2e-3 + 1e-4)
    return raw.reshape(rows, -1)


def random_block_model(name: str, types: list[T], tmp_path: Path) -> tuple[Path, Path]:
    """The same weights as raw blocks (cycling through `types` per tensor) and as F32."""
    hf, config = model(name)
    rng = np.random.default_rng(0)
    quantized, dequantized = {}, {}
    matrices = [k for k, v in hf.state_dict().items() if v.dim() == 2]
    for key, value in hf.state_dict().items():
        if value.dim() != 2:
            quantized[key] = dequantized[key] = value
            continue
        ggml_type = types[matrices.index(key) % len(types)]
        raw = blocks(ggml_type, *value.shape, rng)
        quantized[key] = (raw, ggml_type)
        dequantized[key] = torch.from_numpy(gguf_dequantize(raw, ggml_type).copy())
    q = write_gguf(tmp_path / "q.gguf", config, quantized, tokenizer=False)
    ref = write_gguf(tmp_path / "ref.gguf", config, dequantized, tokenizer=False)
    return q, ref


def assert_reassociation_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(expected).all()
    tolerance = 1e-4 * expected.abs().max().item()
    assert (got - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("ggml_type", SCALED_TYPES, ids=lambda t: t.name)
def test_every_type_gives_the_logits_of_its_dequantized_weights(ggml_type, tmp_path):
    # llama: q/k rows come un-permuted from llama.cpp's layout, blocks and all.
    q, ref = random_block_model("llama", [ggml_type], tmp_path)
    assert_reassociation_close(logits(q), logits(ref))


def test_mixed_types_per_tensor_and_a_quantized_tied_embedding(tmp_path):
    # As in Q4_K_M files: each tensor its own type; qwen2 ties lm_head to the
    # (quantized) embedding and has biases.
    types = [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.Q3_K, T.IQ4_XS, T.Q2_K, T.Q5_K, T.Q4_0]
    q, ref = random_block_model("qwen2", types, tmp_path)
    assert_reassociation_close(logits(q), logits(ref))


def _kquants():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kquants.py"
    spec = importlib.util.spec_from_file_location("kquants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


QUANTIZERS = {
    t: (lambda w, t=t: gguf_quantize(w, t)) for t in (T.Q8_0, T.Q5_1, T.Q5_0, T.Q4_1, T.Q4_0)
}


@pytest.mark.parametrize("ggml_type", [*QUANTIZERS, T.Q6_K, T.Q4_K], ids=lambda t: t.name)
def test_quantized_copies_stay_within_their_quantization_error(ggml_type, tmp_path):
    quantize = (
        QUANTIZERS.get(ggml_type)
        or {
            T.Q6_K: _kquants().quantize_q6_k,
            T.Q4_K: _kquants().quantize_q4_k,
        }[ggml_type]
    )
    hf, config = model("llama")
    state = hf.state_dict()
    quantized, err, norm = {}, 0.0, 0.0
    for key, value in state.items():
        if value.dim() != 2:
            quantized[key] = value
            continue
        raw = quantize(value.numpy())
        quantized[key] = (raw, ggml_type)
        err += float(((gguf_dequantize(raw, ggml_type) - value.numpy()) ** 2).sum())
        norm += float((value.numpy() ** 2).sum())
    relative_weight_error = (err / norm) ** 0.5
    reference = logits(write_gguf(tmp_path / "f32.gguf", config, state, tokenizer=False))
    got = logits(write_gguf(tmp_path / "q.gguf", config, quantized, tokenizer=False))
    moved = ((got - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()
    assert moved <= 3 * relative_weight_error, (moved, relative_weight_error)
