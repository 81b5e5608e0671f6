"""`llmrun quantize` writes the file llama-quantize writes, and refuses bad input in one line.

The expected digests are llama.cpp's: llama_model_quantize of the llama-cpp-python
0.3.36 wheel, run once on the same inputs when this test was written. For the bundled
stories260K (a fixed file) they cover the whole output file: metadata, tensor order,
alignment, types and bytes. For the seeded model of quantize_helpers (written here by
the gguf package, whose header bytes may change between its versions) they cover each
tensor's name, type and bytes in file order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers import STORIES_GGUF
from in_process import llmrun
from quantize_helpers import write_model

from llmrun import quantize
from llmrun.errors import LlmrunError, UsageError
from llmrun.loading.gguf_io import read_gguf
from llmrun.quant.presets import parse_preset

STORIES_FILES = {
    "Q4_K_M": "7f61512f1889080c73b2afd3ac7fdfe55a368e83570b20e5019829adfa734a2a",
    "Q8_0": "ff8701a45da28293b7af11a695ab33575b692e9b109a2eae6238c906c31415da",
    "Q2_K": "94967a2bf35ea5fc57aedcc8fe06e2b94454323b4899a260927830860274267b",
}
# write_model(layers=2, kv_heads=1, tied=False, seed=3) under each preset
RANDOM_TENSORS = {
    "Q4_K_M": "c51fe5f471b1cc17e15da80278005233c2f3334a272ee08d3e9ef977d88e41c0",
    "Q3_K_S": "8badd1e0aabc38379b454f6dff594d97ae1626386f863dae2168a02ed77bef2d",
    "Q5_K_S": "05d6f0084154d7c86af77b6e687d9976b6cb0338aa40461716a547e900f7dd50",
}
# the same model quantized to Q8_0, then that file to Q4_K_M with --allow-requantize
REQUANTIZED_TENSORS = "c3e377eb19a4b05a5639370e15d426d74ba375f0365de94acd5bd660ca239b2a"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tensor_digest(path: Path) -> str:
    gg = read_gguf(path)
    digest = hashlib.sha256()
    for info in gg.tensors.values():
        digest.update(f"{info.name} {info.ggml_type.name}\n".encode())
        digest.update(gg.buffer[info.offset : info.offset + info.nbytes])
    return digest.hexdigest()


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("random") / "model-f16.gguf"
    return write_model(path, layers=2, kv_heads=1, tied=False, seed=3)


def test_quantize_then_run_stories(tmp_path):
    target = tmp_path / "stories-q4_k_m.gguf"
    result = llmrun("quantize", STORIES_GGUF, target, "q4_k_m", "--threads", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"quantizing {STORIES_GGUF} to {target} as Q4_K_M"
    assert lines[1] == "[ 1/48] output.weight [64x512] F32 -> Q8_0, 0.12 MiB -> 0.03 MiB"
    assert lines[-2] == "model size 1.12 MiB (32.00 BPW) -> 0.28 MiB (7.92 BPW)"
    assert lines[-1] == f"wrote {target}"
    assert file_digest(target) == STORIES_FILES["Q4_K_M"]
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary left
    run = llmrun("run", target, "Once upon a time", "-n", "12", "--temperature", "0")
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.split()) >= 6


@pytest.mark.parametrize("preset", ["Q8_0", "Q2_K"])
def test_stories_files_equal_llama_cpps(preset: str, tmp_path):
    target = tmp_path / "out.gguf"
    quantize.quantize_file(STORIES_GGUF, target, parse_preset(preset))
    assert file_digest(target) == STORIES_FILES[preset]


@pytest.mark.parametrize("preset", list(RANDOM_TENSORS))
def test_k_quant_tensors_equal_llama_cpps(preset: str, random_model: Path, tmp_path):
    target = tmp_path / "out.gguf"
    quantize.quantize_file(random_model, target, parse_preset(preset), threads=2)
    assert tensor_digest(target) == RANDOM_TENSORS[preset]


def test_requantize_needs_the_flag_and_then_equals_llama_cpp(random_model: Path, tmp_path):
    q8 = tmp_path / "q8_0.gguf"
    assert llmrun("quantize", random_model, q8, "Q8_0").returncode == 0
    target = tmp_path / "q4_k_m.gguf"
    refused = llmrun("quantize", q8, target, "Q4_K_M")
    assert refused.returncode == 2
    assert refused.stderr == (
        "error: tensor 'output.weight' is already quantized (Q8_0): requantizing loses "
        "quality; pass --allow-requantize to do it anyway\n"
    )
    assert not target.exists()
    result = llmrun("quantize", q8, target, "Q4_K_M", "--allow-requantize")
    assert result.returncode == 0, result.stderr
    assert tensor_digest(target) == REQUANTIZED_TENSORS


def test_metadata_copied_with_type_and_version(random_model: Path, tmp_path):
    target = tmp_path / "out.gguf"
    quantize.quantize_file(random_model, target, parse_preset("Q5_K_M"))
    before, after = read_gguf(random_model).metadata, read_gguf(target).metadata
    assert list(after)[-2:] == ["general.quantization_version", "general.file_type"]
    assert after.pop("general.quantization_version") == 2
    assert after.pop("general.file_type") == 17  # LLAMA_FTYPE_MOSTLY_Q5_K_M
    before.pop("general.file_type")
    assert after == before


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["Q7_K"], 2, "unknown quantization type 'Q7_K'; choose from F32, F16, BF16, Q8_0"),
        (["MXFP4_MOE"], 1, "llmrun quantize cannot write MXFP4_MOE yet"),
        (["Q4_0", "--output-tensor-type", "mxfp4"], 1, "--output-tensor-type: llmrun "),
        (["Q4_0", "--threads", "0"], 2, "--threads must be positive, got 0"),
    ],
)
def test_bad_arguments_are_one_error_line(args: list[str], code: int, message: str, tmp_path):
    result = llmrun("quantize", STORIES_GGUF, tmp_path / "out.gguf", *args)
    assert result.returncode == code
    assert result.stderr.startswith(f"error: {message}")
    assert result.stderr.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_output_over_the_input_is_refused(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(STORIES_GGUF.read_bytes())
    (tmp_path / "link.gguf").symlink_to(source)
    for target in (source, tmp_path / "link.gguf"):
        result = llmrun("quantize", source, target, "Q8_0")
        assert result.returncode == 2
        assert result.stderr == (
            f"error: the output {target} is the input file: give another name\n"
        )
    assert file_digest(source) == file_digest(STORIES_GGUF)


def test_an_interrupted_run_leaves_no_file(tmp_path):
    def interrupt(index: int, total: int, plan: quantize.TensorPlan) -> None:
        if index == 5:
            raise KeyboardInterrupt

    target = tmp_path / "out.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize.quantize_file(STORIES_GGUF, target, parse_preset("Q4_0"), progress=interrupt)
    assert not any(tmp_path.iterdir())


def test_a_full_disk_is_refused_before_writing(tmp_path, monkeypatch):
    usage = quantize.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(quantize.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with pytest.raises(LlmrunError, match="not enough free disk space: the output needs about"):
        quantize.quantize_file(STORIES_GGUF, tmp_path / "out.gguf", parse_preset("Q8_0"))
    assert not any(tmp_path.iterdir())


def test_a_missing_output_folder_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no such directory for the output"):
        quantize.quantize_file(STORIES_GGUF, tmp_path / "no" / "out.gguf", parse_preset("Q8_0"))
