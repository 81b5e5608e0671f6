"""`llmrun quantize --imatrix` writes the bytes llama.cpp writes with an importance matrix.

The expected digests are llama.cpp's, recorded once from the llama-cpp-python 0.3.36
wheel (not installed in CI): the row digests from ggml_quantize_chunk of its
libggml-base.so with the same importance row, the tensor digests from its
llama_model_quantize with `params.imatrix` holding the same per-tensor importances
(benchmarks/llama_cpp_quantize.py --imatrix compares whole files the same way).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from in_process import llmrun
from quantize_helpers import write_model
from test_quantize import tensor_digest

from llmrun import imatrix, quantize
from llmrun.loading.gguf_io import read_gguf
from llmrun.quant.presets import parse_preset

T = GGMLQuantizationType
ROW_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
# ggml_quantize_chunk(type, seeded_rows(), ..., seeded_importance(512))
ROW_DIGESTS = {
    "Q4_0": "9dd9697578c893ec9d438a106a8d3c2509e3d4afcf5601cae5c23711d91bfff5",
    "Q4_1": "b855cd2610da4b943efac731b35112fb142404e60d9b442aa9abcea487334e4c",
    "Q5_0": "3c6cc18fb6d166241cc35aec61960e4d4f972841414ef3423b4f6a90a6e14962",
    "Q5_1": "03dbc15403ba7d570cb23289aea072d6e4a070475462527927855eb4bff99c6a",
    "Q8_0": "015308c6e7b3aafb3eb9aef34354cc3a98871cd0559dca9d08735fd6ab874423",
    "Q2_K": "d1b9e940c92ac6836c87c77c1a494adf0b5c503a844a1b4f20a59742fc406b74",
    "Q3_K": "22b61c4436b40a96e9b1d5f481f27f65806df2508ae81749d319be074c1c2996",
    "Q4_K": "0360486985d2f41577f01bc58fc93e6d7f73d38f7f58c7e32da1fd1081eebc04",
    "Q5_K": "20e446e8b1a5b1862be1f6e3e3a35fa2fc639a5d5773e8863e2212cc96ac2793",
    "Q6_K": "bb36c0849219721a55851ec641ae0461abc02e78692cf492d71370af4818bdc3",
}
# 8 layers, so that Q4_0's ffn_down of layer 0 takes Q4_1 as it does with an imatrix
MODELS = {
    "dense": dict(layers=8, kv_heads=1, tied=False, seed=3),
    "experts": dict(layers=2, kv_heads=2, tied=False, experts=8, seed=4),
}
# llama_model_quantize(MODELS[model], preset, imatrix=importance_rows_of(model))
FILE_DIGESTS = {
    ("dense", "Q4_K_M"): "cbe7335091d2e0c80d498132bff641e9f0bc05d497cced1ab30d897b9660fff5",
    ("dense", "Q2_K"): "d41ad294dae76b09a4e7675d720071dc47ac7805f3f0b81d41ea0c856f3f61be",
    ("dense", "Q4_0"): "7461241fe58c1a88e2e85f6ca1a09b98e5dbd5e41be92db7e3f4363d3b67330a",
    ("dense", "Q5_K_M"): "21444bc4c74483e53a1fad6da35e886cb01f1c30cdc484cd993dedb515fa0389",
    ("experts", "Q4_K_M"): "72d3087fcd99eca890267bdb92203339315937455bab1eab596006b25c9bdb6a",
}


def seeded_rows() -> np.ndarray:
    """Rows of 512 weights: normal ones at several scales, heavy tails, and edge rows
    (zeros, a constant, one huge value, tiny values, all negative, all positive)."""
    rng = np.random.default_rng(5)
    n = 512
    huge = np.zeros(n)
    huge[100] = 1e4
    edges = [np.zeros(n), np.full(n, 0.5), huge, rng.standard_normal(n) * 1e-20]
    edges += [-np.abs(rng.standard_normal(n)), np.abs(rng.standard_normal(n))]
    tails = rng.standard_normal((4, n)) * np.where(rng.random((4, n)) < 0.05, 30, 1)
    normal = rng.standard_normal((18, n)) * rng.uniform(0.01, 5, (18, 1))
    return np.vstack([edges, tails, normal]).astype(np.float32)


def seeded_importance(n: int) -> np.ndarray:
    """A positive importance row, with some columns no token reached (0)."""
    values = np.random.default_rng(6).uniform(0.05, 3, n)
    values[::37] = 0
    return values.astype(np.float32)


def importance_rows_of(model: Path) -> dict[str, np.ndarray]:
    """Seeded importances for every matrix of a GGUF, experts one after another."""
    rng = np.random.default_rng(11)
    out = {}
    for info in read_gguf(model).tensors.values():
        if len(info.shape) >= 2:
            experts = info.shape[0] if len(info.shape) == 3 else 1
            out[info.name] = rng.uniform(0.05, 3, info.shape[-1] * experts).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    return {name: write_model(folder / f"{name}.gguf", **kw) for name, kw in MODELS.items()}


@pytest.mark.parametrize("ggml_type", ROW_TYPES, ids=lambda t: t.name)
def test_rows_equal_ggml_with_an_importance_row(ggml_type: GGMLQuantizationType):
    rows = seeded_rows()
    written = quantize.quantize_rows(rows, ggml_type, 2, seeded_importance(rows.shape[1]))
    assert hashlib.sha256(written.tobytes()).hexdigest() == ROW_DIGESTS[ggml_type.name]
    plain = quantize.quantize_rows(rows, ggml_type, 2)
    assert np.array_equal(written, plain) == (ggml_type == T.Q8_0)  # Q8_0 ignores it


@pytest.mark.parametrize("model, preset", list(FILE_DIGESTS))
def test_tensors_equal_llama_cpps_with_an_imatrix(model: str, preset: str, models, tmp_path):
    target = tmp_path / "out.gguf"
    means = importance_rows_of(models[model])
    quantize.quantize_file(models[model], target, parse_preset(preset), imatrix=means, threads=2)
    assert tensor_digest(target) == FILE_DIGESTS[model, preset]


def _imatrix_file(path: Path, means: dict[str, np.ndarray], output_format: str) -> Path:
    """An imatrix file whose means are `means`: sums of one token each."""
    entries = {name: imatrix.Entry(v[None], np.array([1])) for name, v in means.items()}
    imatrix.write(imatrix.Imatrix(entries, ["text.txt"], 3, 512), path, output_format)
    return path


@pytest.mark.parametrize("output_format", ["gguf", "dat"])
def test_cli_reads_the_imatrix_file_and_records_it(output_format: str, models, tmp_path):
    means = importance_rows_of(models["dense"])
    source = _imatrix_file(tmp_path / f"imatrix.{output_format}", means, output_format)
    target = tmp_path / "out.gguf"
    result = llmrun("quantize", models["dense"], target, "Q4_K_M", "--imatrix", source)
    assert result.returncode == 0, result.stderr
    assert tensor_digest(target) == FILE_DIGESTS["dense", "Q4_K_M"]
    metadata = read_gguf(target).metadata
    assert list(metadata)[-6:-4] == ["general.quantization_version", "general.file_type"]
    assert {k: metadata[k] for k in list(metadata)[-4:]} == {
        "quantize.imatrix.file": str(source),
        "quantize.imatrix.dataset": "text.txt",
        "quantize.imatrix.entries_count": len(means),
        "quantize.imatrix.chunks_count": 3,
    }


def test_cli_refuses_a_bad_imatrix_in_one_line(models, tmp_path):
    means = importance_rows_of(models["dense"])
    target = tmp_path / "out.gguf"
    cases = []
    wrong_size = dict(means, **{"blk.0.attn_q.weight": np.ones(100, np.float32)})
    cases.append((_imatrix_file(tmp_path / "size.gguf", wrong_size, "gguf"), "has 100 values"))
    nan = dict(means, **{"blk.1.ffn_up.weight": np.full(256, np.nan, np.float32)})
    cases.append((_imatrix_file(tmp_path / "nan.gguf", nan, "gguf"), "NaN or infinite"))
    other = {"blk.0.attn_z.weight": np.ones(256, np.float32)}
    cases.append((_imatrix_file(tmp_path / "other.gguf", other, "gguf"), "another model"))
    cut = tmp_path / "cut.dat"
    cut.write_bytes(_imatrix_file(tmp_path / "whole.dat", means, "dat").read_bytes()[:50])
    cases.append((cut, "not an imatrix file"))
    cases.append((tmp_path / "missing.gguf", "no such imatrix file"))
    cases = [(path, "Q4_K_M", message) for path, message in cases]
    partial = {k: v for k, v in means.items() if k != "blk.0.ffn_up.weight"}
    message = "no entry for tensor 'blk.0.ffn_up.weight', which IQ2_XXS makes IQ2_XXS"
    cases.append((_imatrix_file(tmp_path / "partial.gguf", partial, "gguf"), "IQ2_XXS", message))
    for path, preset, message in cases:
        result = llmrun("quantize", models["dense"], target, preset, "--imatrix", path)
        assert result.returncode != 0, path
        assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1
        assert not target.exists()
