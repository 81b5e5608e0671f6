"""The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary
types (TQ1_0, TQ2_0) against independent references.

- Dequantization: bit-exact with gguf's numpy code, whose grid and sign tables are
  llama.cpp's (ggml-common.h), by the torch code and by each native kernel family;
  test_quant_blocks.py and test_quant_kernels.py cover a few shapes of every type, this
  file enough random blocks to reach every grid row and sign pattern.
- A tiny Llama whose every matrix (embedding and output too) is one of these types:
  llmrun's logits from the GGUF equal transformers' on gguf's dequantized weights, max
  abs difference <= 1e-4 (the logits reach past ±1), whole and through the KV cache;
  `llmrun run` picks transformers' greedy tokens and `llmrun show` names the types.
- With 8-bit activations (`--activations q8`), the same Llama of these types and IQ4_NL
  and IQ4_XS (Q8_TYPES), through the native decode step and through its layers: each
  decoded token's products equal gguf's dequantized weights times the activations
  quantized as llama.cpp quantizes them (test_q8_kernels' reference; 1e-5 of the
  largest output), and its logits stay within 5 % of the largest exact logit (3.3 %
  here; the same Llama of Q4_0 moves 0.5 %, Q8_0 1.7 %, IQ4_XS 3.2 %, Q6_K 2.9 %: Q8_K
  activations have one scale per 256 values, Q8_0's one per 32).
"""

import json

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from helpers import BASE, cached_logits, write_gguf
from in_process import llmrun
from test_q8_kernels import quantized_activations
from test_quant_blocks import assert_same_bits, random_blocks, write_scales

from llmrun.loading.loader import load_model
from llmrun.quant import kernels
from llmrun.quant.blocks import dequantize
from llmrun.quant.linear import QuantEmbedding, QuantLinear, set_activations
from llmrun.tokenizer import load_tokenizer

T = GGMLQuantizationType
IQUANTS = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
TERNARY = [T.TQ1_0, T.TQ2_0]
TYPES = IQUANTS + TERNARY
# With the 4-bit i-quants, for the 8-bit-activation kernels (llmrun/native/q8_avx512.c,
# q8_avx2.c).
Q8_TYPES = [T.IQ4_NL, T.IQ4_XS, *TYPES]
CPU = torch.device("cpu")
# Every width a multiple of 256, the types' block.
LLAMA = dict(
    BASE,
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    rope_theta=10000.0,
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
WEIGHT_RMS = 0.05


def many_blocks(ggml_type: T) -> np.ndarray:
    """2048 random blocks [8, 256 blocks]: up to 65536 grid indices (IQ1_S's grid has
    2048 rows), 16384 sign bytes."""
    return random_blocks(ggml_type, 8, 2048 * 256 // 8, seed=int(ggml_type))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_many_blocks_are_bit_exact_with_gguf(ggml_type: T):
    raw = many_blocks(ggml_type)
    assert_same_bits(
        dequantize(torch.from_numpy(raw), ggml_type).numpy(), gguf_dequantize(raw, ggml_type)
    )


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_many_blocks_are_bit_exact_in_the_native_kernels(ggml_type: T, native_kernels: str):
    raw = many_blocks(ggml_type)
    assert kernels.supports(ggml_type, raw.shape[1] // GGML_QUANT_SIZES[ggml_type][1] * 256)
    got = kernels.dequantize(torch.from_numpy(raw), ggml_type)
    assert_same_bits(got.numpy(), gguf_dequantize(raw, ggml_type))


def model_blocks(
    ggml_type: T, rows: int, cols: int, rng, rms: float = WEIGHT_RMS
) -> tuple[np.ndarray, torch.Tensor]:
    """Random blocks whose weights have an RMS near `rms`, and gguf's dequantization."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    write_scales(raw, ggml_type, np.ones)
    unit_rms = np.sqrt(np.mean(gguf_dequantize(raw, ggml_type) ** 2))
    write_scales(raw, ggml_type, lambda n: rms / unit_rms * rng.uniform(0.5, 1.5, n))
    raw = raw.reshape(rows, -1)
    return raw, torch.from_numpy(gguf_dequantize(raw, ggml_type).copy())


def llama_of(types: list[T], directory):
    """transformers' Llama on gguf's dequantized weights and the GGUF of their blocks in
    `directory`, the matrices' types cycling through `types`."""
    import transformers

    config = transformers.AutoConfig.for_model(**LLAMA)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    blocks, state = {}, hf.state_dict()
    matrices = [k for k, v in state.items() if v.dim() == 2]
    for key, value in state.items():
        if value.dim() == 1:
            value.normal_(1.0, 0.1)  # RMSNorm scales
            blocks[key] = value
            continue
        ggml_type = types[matrices.index(key) % len(types)]
        blocks[key], dequantized = model_blocks(ggml_type, *value.shape, rng)
        blocks[key] = (blocks[key], ggml_type)
        value.copy_(dequantized)
    path = write_gguf(directory / "iq.gguf", config.to_dict(), blocks)
    return hf, path


@pytest.fixture(scope="module")
def iquant_llama(tmp_path_factory):
    """llama_of(TYPES)."""
    return llama_of(TYPES, tmp_path_factory.mktemp("iq"))


def test_a_llama_of_iquants_gives_transformers_logits(iquant_llama):
    hf, path = iquant_llama
    model = load_model(path, CPU, "f32").model
    layers = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert {m.ggml_type for m in layers} == set(TYPES)
    with torch.no_grad():
        expected = hf(IDS).logits
        got = model(IDS, torch.arange(IDS.shape[1])[None])
    assert expected.abs().max() > 1
    assert (got - expected).abs().max().item() <= 1e-4
    assert (cached_logits(model, IDS) - expected).abs().max().item() <= 1e-4


def test_llmrun_run_picks_transformers_greedy_tokens_and_show_lists_the_types(iquant_llama):
    hf, path = iquant_llama
    prompt = load_tokenizer(path).encode("Once upon a time")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    run = llmrun(
        "run", str(path), "Once upon a time", "-n", "12", "--temperature", "0",
        "--json", "--logprobs", "1",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert [entry["id"] for entry in json.loads(run.stdout)["logprobs"]] == out[
        0, len(prompt) :
    ].tolist()
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert all(t.name in shown.stdout for t in TYPES), shown.stdout


@pytest.fixture(scope="module")
def q8_llama(tmp_path_factory):
    """llama_of(Q8_TYPES)."""
    return llama_of(Q8_TYPES, tmp_path_factory.mktemp("q8"))


def test_8_bit_activations_multiply_as_llama_cpp(q8_llama, native_kernels):
    _, path = q8_llama
    model = load_model(path, CPU, "f32").model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {m.ggml_type for m in layers} == set(Q8_TYPES)
    exact = cached_logits(model, IDS)
    assert set_activations(model, "q8") == len(layers)
    step, taken = model.decode_step, []

    def counted_step(*args, **kwargs):
        out = step(*args, **kwargs)
        taken.append(out is not None)
        return out

    model.decode_step = counted_step
    q8 = cached_logits(model, IDS)
    assert any(taken)  # the tokens after the prefills decoded through the native step
    distance = (q8 - exact).abs().max().item()
    assert 1e-3 < distance <= 0.05 * exact.abs().max().item()

    model.decode_step = None  # each layer's own call, to check it
    calls = []
    hooks = [m.register_forward_hook(lambda m, x, y: calls.append((m, x[0], y))) for m in layers]
    cached_logits(model, IDS)
    for hook in hooks:
        hook.remove()
    decoded = [(m, x, y) for m, x, y in calls if x.shape[1] == 1]
    assert {m for m, _, _ in decoded} == set(layers)
    for layer, x, y in decoded:
        w = gguf_dequantize(layer.weight.numpy(), layer.ggml_type).astype(np.float64)
        expected = quantized_activations(x.reshape(1, -1).numpy(), layer.ggml_type) @ w.T
        np.testing.assert_allclose(
            y.reshape(1, -1).numpy(), expected, rtol=0, atol=1e-5 * np.abs(expected).max()
        )
