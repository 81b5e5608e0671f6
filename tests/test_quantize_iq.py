"""`llmrun quantize` writes llama-quantize's files under the i-quant, ternary and Q2_K_S
presets, with an importance matrix where the mix needs one, and refuses those mixes
without one in one line.

The expected digests are llama.cpp's: llama_model_quantize of the llama-cpp-python 0.3.36
wheel, run once on the same inputs when this test was written (with params.imatrix set to
the seeded importances below). For the bundled stories260K they cover the whole file (its
rows of 64 take the fallback types); for test_quantize's seeded model, each tensor's name,
type and bytes in file order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import STORIES_GGUF
from in_process import llmrun
from quantize_helpers import write_model
from test_quantize import file_digest, tensor_digest

from llmrun import quantize
from llmrun.loading.gguf_io import read_gguf
from llmrun.quant.presets import parse_preset

# write_model(layers=2, kv_heads=1, tied=False, seed=3) under each preset, without an
# importance matrix (the mixes that need none) ...
RANDOM_TENSORS = {
    "IQ4_NL": "e4fb13006c2fee1c441ef1fb683a0a7c14c19f8906d41367ef2e0e506d9f8aaa",
    "IQ4_XS": "e45879b66d18e78598c6a970fb2cdf2f2f617f15b95b2933a9821448846ab077",
    "IQ3_S": "8d3869ddd79837f0b0753b982ef5f66a20c4c334c6e00e684ff0807b0b6a1a1f",
    "IQ3_M": "61ec145bd846ad00b7f27ddc83f5465eb632ef53d28a58f0ce7160b833badfe8",
    "TQ1_0": "b89053f5e00893fb36857bc790cda9b905f336ceef42a0b4522352e25451d0c8",
    "TQ2_0": "5d940cc56eb01cd7d8ea43bc42bf1984446148a4bdabe66a6c32ad4d302946c9",
}
# ... and with seeded_imatrix's
RANDOM_TENSORS_IMATRIX = {
    "IQ4_XS": "37ebe2a1543d83292037dca9b38427ccd9bf63638e19a786cb3efa9f30d4ceef",
    "IQ3_XXS": "63a3d4267bf6e2521d25ec9ed387414a4f6822985477e78e147e971403512195",
    "IQ3_XS": "e7ac6bb45d3c5ceaabbfca55ec86935affb1383d21436e670046519d10a89a78",
    "IQ2_M": "1f97b1c2a9f596d25fe8266336861ac16a0de79678cd1ed4196b33977efeb1dc",
    "IQ2_S": "a73960f035073322e43c4ce8da7ca0bc075bfd965297a01cf6b299a2c374021f",
    "IQ2_XS": "b21f66190a5d5ee2ea5508d7f43614d28f6203d85d6f39f49dbf18b35ebeed1b",
    "IQ2_XXS": "54ef692ed079801b36ff99f31492586fd6911767467a92b5db44c36de1aabea9",
    "IQ1_M": "e40dcf0af6e1875bb89a4245ecf4cb4211bf7a9c349c1a47912d25a4a09b19a2",
    "IQ1_S": "4e0150b0ca7ef750615cccc2ec9e5691ed50d673b5a03bf9eb753ce59a716a0b",
    "Q2_K_S": "bba0038e2ee4f52344135e7d8b6dbfbd9e93d2203221303d2a8f7e916a55c0f3",
}
STORIES_FILES = {
    "IQ4_XS": "4d8614ce3f2eb632bfe3f11e8746469c50bd3d3570b4cb480bd19fade988bcde",
    "IQ2_XXS": "4bf25f34557a70a9d03d3ae19fa7b4d18a6a474c051cba968465bbcbb5f4feec",
}


def seeded_imatrix(path: Path, seed: int = 11) -> dict[str, np.ndarray]:
    """Importances in [0.1, 4) for each 2-D tensor but token_embd.weight, by name in order."""
    rng = np.random.default_rng(seed)
    tensors = read_gguf(path).tensors
    return {
        name: rng.uniform(0.1, 4.0, tensors[name].shape[-1]).astype(np.float32)
        for name in sorted(tensors)
        if len(tensors[name].shape) >= 2 and name != "token_embd.weight"
    }


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("random") / "model-f16.gguf"
    return write_model(path, layers=2, kv_heads=1, tied=False, seed=3)


@pytest.mark.parametrize("preset", list(RANDOM_TENSORS))
def test_tensors_equal_llama_cpps(preset: str, random_model: Path, tmp_path):
    target = tmp_path / "out.gguf"
    quantize.quantize_file(random_model, target, parse_preset(preset), threads=2)
    assert tensor_digest(target) == RANDOM_TENSORS[preset]


@pytest.mark.parametrize("preset", list(RANDOM_TENSORS_IMATRIX))
def test_tensors_with_an_imatrix_equal_llama_cpps(preset: str, random_model: Path, tmp_path):
    target = tmp_path / "out.gguf"
    imatrix = seeded_imatrix(random_model)
    quantize.quantize_file(random_model, target, parse_preset(preset), threads=2, imatrix=imatrix)
    assert tensor_digest(target) == RANDOM_TENSORS_IMATRIX[preset]


def test_stories_iq4_xs_equals_llama_cpps_and_runs(tmp_path):
    target = tmp_path / "stories-iq4_xs.gguf"
    result = llmrun("quantize", STORIES_GGUF, target, "iq4_xs")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[1] == (
        "[ 1/48] output.weight [64x512] F32 -> Q8_0, 0.12 MiB -> 0.03 MiB"
    )
    assert "blk.0.attn_q.weight [64x64] F32 -> IQ4_NL" in result.stderr
    assert file_digest(target) == STORIES_FILES["IQ4_XS"]
    run = llmrun("run", target, "Once upon a time", "-n", "12", "--temperature", "0")
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.split()) >= 6


def test_stories_iq2_xxs_falls_back_as_llama_cpp_does(tmp_path):
    # rows of 64 take no 256-weight type: every one falls back to IQ4_NL, which needs no
    # importance matrix, so llama.cpp writes the file without one
    target = tmp_path / "out.gguf"
    quantize.quantize_file(STORIES_GGUF, target, parse_preset("IQ2_XXS"))
    assert file_digest(target) == STORIES_FILES["IQ2_XXS"]


@pytest.mark.parametrize("preset", ["IQ2_XXS", "IQ1_M", "Q2_K_S"])
def test_a_mix_that_needs_an_imatrix_is_refused_without_one(
    preset: str, random_model: Path, tmp_path
):
    result = llmrun("quantize", random_model, tmp_path / "out.gguf", preset)
    assert result.returncode == 2
    tensor_type = parse_preset(preset).default_type.name
    assert result.stderr == (
        f"error: {preset} needs an importance matrix: tensor 'blk.0.attn_k.weight' would be "
        f"{tensor_type}; pass --imatrix FILE (made by llmrun imatrix or llama-imatrix)\n"
    )
    assert not any(tmp_path.iterdir())
