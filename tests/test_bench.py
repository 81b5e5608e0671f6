"""llmrun bench: every field in every output format, arithmetic that adds up, clear
errors. Tiny sizes on stories260K; no test asserts a speed."""

import csv
import io
import json
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import gguf
import pytest
import torch
from helpers import tiny_hf_model, write_gguf
from in_process import llmrun as llmrun_cli

import llmrun
from llmrun import api, bench, native, paths, ui
from llmrun.errors import UsageError

FIELDS = {
    "llmrun_version", "torch_version", "device", "device_name", "cpu", "cpu_kernels", "model",
    "model_path",
    "architecture", "format", "quant", "n_params", "model_bytes", "weight_bytes_per_token",
    "dtype", "cache_type", "activations", "load_s", "threads", "test", "n_prompt", "n_gen", "n_depth", "n_batch",
    "repetitions", "avg_ts", "stddev_ts", "samples_ts", "avg_s", "ttft_ms",
    "peak_memory_bytes", "memory_source", "gbps", "roofline_gbps", "roofline_pct", "date",
    "kv_cache_bytes", "kv_bytes_per_token",
}  # fmt: skip
TESTS = ["pp16", "tg8", "pp16+tg8", "pp16 @ d4", "tg8 @ d4", "pp16+tg8 @ d4"]


def reference_bytes_per_token(path) -> int:
    """From the GGUF file alone: every tensor once, the embedding table as one row
    unless the output projection is tied to it (then it is read whole, plus the row)."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embed = tensors["token_embd.weight"]
    total = sum(int(t.n_bytes) for t in tensors.values()) + int(embed.n_bytes) // int(
        embed.shape[-1]
    )
    return total - (int(embed.n_bytes) if "output.weight" in tensors else 0)


@pytest.fixture(scope="module")
def records():
    result = llmrun_cli(
        "bench", "-p", "16", "-n", "8", "--pg", "16,8", "-d", "0,4", "-t", "1", "-b", "8",
        "-r", "2", "-o", "json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress display in a pipe
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def tied_q4_model(tmp_path_factory):
    model, config = tiny_hf_model("qwen2")
    path = tmp_path_factory.mktemp("bench") / "tiny-qwen2.gguf"
    return write_gguf(path, config, model.state_dict(), gguf.GGMLQuantizationType.Q4_0)


def test_every_test_and_field(records):
    assert [r["test"] for r in records] == TESTS
    assert [r["threads"] for r in records] == [1] * 6
    for r in records:
        assert set(r) == FIELDS
        assert (r["n_prompt"], r["n_gen"]) in [(16, 0), (0, 8), (16, 8)]
        assert r["n_depth"] == (4 if "@ d4" in r["test"] else 0)
        assert r["n_batch"] == 8
        assert r["repetitions"] == 2 and len(r["samples_ts"]) == 2


def test_the_default_batch_is_the_chunk_run_feeds_a_prompt_in():
    result = llmrun_cli("bench", "-p", "16", "-n", "0", "-r", "1", "-o", "json")
    assert result.returncode == 0, result.stderr
    assert [r["n_batch"] for r in json.loads(result.stdout)] == [512]


def test_records_identify_machine_and_model(records):
    path = paths.BUNDLED_MODEL
    for r in records:
        assert r["llmrun_version"] == llmrun.__version__
        assert r["torch_version"] == torch.__version__
        assert r["device"] == "cpu" and r["device_name"] == r["cpu"] and r["cpu"]
        assert r["cpu_kernels"] == native.status()
        assert r["cpu_kernels"].startswith(("native (", "torch fallback: "))
        assert (r["model"], r["architecture"], r["format"]) == ("stories260K", "llama", "gguf")
        assert (r["quant"], r["dtype"]) == ("F32", "f32")
        assert r["model_path"] == str(path)
        assert r["n_params"] == 292800
        assert r["model_bytes"] == path.stat().st_size
        assert r["weight_bytes_per_token"] == reference_bytes_per_token(path)
        assert r["memory_source"] == "peak rss"
        assert r["peak_memory_bytes"] > r["model_bytes"]
        assert r["load_s"] > 0
        datetime.fromisoformat(r["date"])


def test_arithmetic_is_consistent(records):
    for r in records:
        tokens = r["n_prompt"] + r["n_gen"]
        assert r["avg_ts"] == pytest.approx(statistics.fmean(r["samples_ts"]))
        assert r["stddev_ts"] == pytest.approx(statistics.stdev(r["samples_ts"]))
        # Each sample is tokens / its run's seconds, so the seconds are recoverable.
        seconds = [tokens / s for s in r["samples_ts"]]
        assert r["avg_s"] == pytest.approx(statistics.fmean(seconds))
        assert 0 < r["ttft_ms"] <= r["avg_s"] * 1e3 * 1.0001
        if r["n_prompt"]:
            assert r["gbps"] is None
        else:
            assert r["gbps"] == pytest.approx(r["weight_bytes_per_token"] * r["avg_ts"] / 1e9)
        assert r["roofline_gbps"] is None and r["roofline_pct"] is None


@pytest.mark.parametrize("output", ["json", "jsonl", "csv"])
def test_machine_formats_round_trip(records, output, capsys):
    ui.print_bench(records, output)
    text = capsys.readouterr().out
    if output == "json":
        assert json.loads(text) == records
    elif output == "jsonl":
        assert [json.loads(line) for line in text.splitlines()] == records
    else:
        rows = list(csv.DictReader(io.StringIO(text)))
        assert len(rows) == len(records)
        for row, r in zip(rows, records, strict=True):
            assert set(row) == FIELDS
            assert row["test"] == r["test"]
            assert float(row["avg_ts"]) == r["avg_ts"]
            assert [float(v) for v in row["samples_ts"].split()] == r["samples_ts"]
            assert row["gbps"] == ("" if r["gbps"] is None else str(r["gbps"]))


@pytest.mark.parametrize("terminal", [False, True])
def test_human_tables(records, terminal, capsys, monkeypatch):
    monkeypatch.setattr(ui, "stdout_is_tty", lambda: terminal)
    ui.print_bench(records, None if terminal else "md")
    text = capsys.readouterr().out
    for column in ("model", "quant", "size", "params", "weights/token", "threads", "test"):
        assert column in text
    for column in ("t/s", "TTFT ms", "GB/s", "peak mem", "load s"):
        assert column in text
    assert "batch" not in text  # one batch size: no column
    assert f"llmrun {llmrun.__version__}, torch {torch.__version__}" in text
    r = records[1]
    assert f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}" in text
    assert f"{r['gbps']:.2f}" in text
    if not terminal:
        lines = text.splitlines()
        assert lines[0].startswith("| model | quant |")
        assert all(line.startswith("| stories260K |") for line in lines[2:8])
        assert lines[8] == ""


def test_the_footer_names_the_kernels(records, capsys):
    """It read 'cpu: X (native (AVX-512) kernels)', and with the torch fallback
    'cpu: X (torch fallback: REASON kernels)'; and 'of 1 runs' for -r 1."""
    fallback = [{**r, "cpu_kernels": "torch fallback: no C compiler"} for r in records]
    for runs, kernels in [(records, native.status()), (fallback, "torch fallback: no C compiler")]:
        ui.print_bench(runs, "md")
        footer = capsys.readouterr().out.splitlines()[-1]
        assert footer.startswith(
            f"llmrun {llmrun.__version__}, torch {torch.__version__}, cpu: {records[0]['cpu']}, "
            f"kernels: {kernels}. t/s: mean ± sd of 2 runs after a warm-up; "
        )
    ui.print_bench([{**records[0], "repetitions": 1}], "md")
    assert "t/s: mean ± sd of 1 run after a warm-up; " in capsys.readouterr().out


def test_several_models_one_markdown_table(tied_q4_model):
    result = llmrun_cli(
        "bench", str(paths.BUNDLED_MODEL), str(tied_q4_model), "-p", "8", "-n", "4", "-r", "1"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[:6]]
    table = [dict(zip(header, row, strict=True)) for row in rows[1:]]
    assert [(r["model"], r["quant"], r["test"]) for r in table] == [
        ("stories260K", "F32", "pp8"),
        ("stories260K", "F32", "tg4"),
        ("tiny-qwen2", "Q4_0", "pp8"),
        ("tiny-qwen2", "Q4_0", "tg4"),
    ]
    assert lines[6] == "" and lines[7].startswith("llmrun ")


def test_compare_script_prints_ratios_and_skips_missing_peers():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"
    result = subprocess.run(
        [sys.executable, str(script), str(paths.BUNDLED_MODEL), "-p", "8", "-n", "4", "-r", "1"]
        + ["-t", "1", "--engines", "llmrun,llama.cpp", "--llama-cpp-python", "/nonexistent/py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "stories260K.gguf, 1 threads, mean ± sd of 1 runs after a warm-up"
    assert (
        lines[2] == "| engine | pp8 t/s | tg4 t/s | llmrun / engine, pp8 | llmrun / engine, tg4 |"
    )
    assert lines[4].startswith(f"| llmrun {llmrun.__version__} (F32, f32) | ")
    assert lines[4].endswith(" | 1.00 | 1.00 |")
    assert lines[-1].startswith("llama.cpp skipped: cannot run /nonexistent/py")


def test_bytes_per_token_of_a_tied_quantized_model(tied_q4_model):
    engine = api.load(str(tied_q4_model), device="cpu")
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert bench.weight_bytes_per_token(engine.model) == reference_bytes_per_token(tied_q4_model)
    assert bench.quant_name(engine.checkpoint) == "Q4_0"


def test_kv_bytes_of_a_model_with_sliding_windows(tmp_path):
    """Gemma 3 (helpers.CONFIGS["gemma3"]): one global layer holds every position, five
    local ones their window of 5. The test repeats from a depth past the window, which
    the rings only hold again because bench restores them before each run."""
    from llmrun.models import kv_cache_bytes

    model, config = tiny_hf_model("gemma3")
    path = write_gguf(tmp_path / "tiny-gemma3.gguf", config, model.state_dict())
    records = bench.benchmark([str(path)], options(depths=[12], repetitions=2, device="cpu"))
    per_position = 2 * 2 * 32 * 4  # keys and values, 2 KV heads of 32, f32
    for r in records:
        positions = r["n_depth"] + r["n_prompt"] + r["n_gen"]
        assert r["kv_cache_bytes"] == per_position * (positions + 5 * 5)
        assert r["kv_bytes_per_token"] == r["kv_cache_bytes"] / positions
    engine = api.load(str(path), device="cpu")
    assert engine.new_state(64).cache.nbytes == kv_cache_bytes(engine.checkpoint.config, 64)


def options(**changes) -> bench.BenchOptions:
    base = dict(n_prompt=[8], n_gen=[4], pg=[], depths=[0], batches=[512], threads=[None])
    return bench.BenchOptions(**{**base, "repetitions": 1, **changes})


def test_roofline_percentage(monkeypatch):
    assert bench.read_bandwidth(torch.device("cpu"), nbytes=1 << 24, repeats=2) > 0
    monkeypatch.setattr(bench, "read_bandwidth", lambda device: 20.0)
    records = bench.benchmark([None], options(n_prompt=[0], roofline=True))
    (r,) = records
    assert r["roofline_gbps"] == 20.0
    assert r["roofline_pct"] == pytest.approx(100 * r["gbps"] / 20.0)


def test_thread_lists_and_progress_counts_every_run():
    opts = options(n_gen=[2], pg=[(8, 2)], threads=[1, 2])
    done = []
    records = bench.benchmark([None, None], opts, lambda what, n: done.append(n))
    assert [(r["threads"], r["test"]) for r in records] == 2 * [
        (1, "pp8"), (1, "tg2"), (1, "pp8+tg2"), (2, "pp8"), (2, "tg2"), (2, "pp8+tg2")
    ]  # fmt: skip
    assert sum(done) == bench.total_runs(opts, 2) == 2 * 6 * (1 + 1)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(repetitions=0), "-r/--repetitions must be at least 1, got 0"),
        (dict(n_prompt=[-1]), "-p/--n-prompt must be at least 0, got -1"),
        (dict(batches=[0]), "-b/--batch-size must be at least 1, got 0"),
        (dict(threads=[0]), "-t/--threads must be at least 1, got 0"),
        (dict(depths=[-4]), "-d/--n-depth must be at least 0, got -4"),
        (dict(pg=[(0, 4)]), "--pg needs a positive prompt and generation length, got 0,4"),
        (dict(n_prompt=[0], n_gen=[0]), "nothing to run: -p and -n are both 0"),
    ],
)
def test_bad_options(changes, message):
    with pytest.raises(UsageError, match="^" + message.replace("+", r"\+")):
        options(**changes).validate()


def test_bad_lists():
    assert bench.parse_ints("-p", "128,512") == [128, 512]
    assert bench.parse_pg("512,128") == (512, 128)
    with pytest.raises(UsageError, match="expected comma-separated integers, got '1,,2'"):
        bench.parse_ints("-p", "1,,2")
    with pytest.raises(UsageError, match=r"--pg takes PROMPT,GEN \(two integers\), got '512'"):
        bench.parse_pg("512")


@pytest.mark.parametrize(
    "args, message",
    [
        (["-p", "abc"], "error: -p/--n-prompt: expected comma-separated integers, got 'abc'"),
        (["-o", "xml"], "error: -o/--output must be one of json, jsonl, csv, md, got 'xml'"),
    ],
)
def test_bad_arguments_are_one_error_line(args, message):
    result = llmrun_cli("bench", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == message + "\n"


def test_test_longer_than_the_context_is_an_error():
    result = llmrun_cli("bench", "--pg", "2000,100", "-r", "1")
    assert result.returncode == 2
    assert result.stderr == (
        "error: test pp2000+tg100 needs 2100 positions, but stories260K holds 2048; "
        "use smaller -p/-n/-d/--pg\n"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_records():
    (pp, tg) = bench.benchmark([None], options(device="cuda"))
    for r in (pp, tg):
        assert r["device"] == "cuda"
        assert r["device_name"] == torch.cuda.get_device_name()
        assert r["memory_source"] == "cuda max allocated"
        assert r["peak_memory_bytes"] >= r["weight_bytes_per_token"]
    assert tg["gbps"] == pytest.approx(tg["weight_bytes_per_token"] * tg["avg_ts"] / 1e9)
    assert bench.read_bandwidth(torch.device("cuda"), nbytes=1 << 26, repeats=2) > 0


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="no Apple MPS device")
def test_mps_records():
    (pp, tg) = bench.benchmark([None], options(device="mps"))
    for r in (pp, tg):
        assert r["device"] == "mps"
        assert r["memory_source"] == "mps driver allocated"
        assert r["peak_memory_bytes"] > 0


def test_a_missing_model_is_found_before_any_runs():
    """`bench A B` with B missing: the error comes before A's runs, which it threw away."""
    from llmrun.errors import ModelNotFoundError

    options = bench.BenchOptions.from_flags("8", "2", [], "0", "8", "1", 1, "cpu", "auto", False)
    seen = []
    with pytest.raises(ModelNotFoundError, match="/nonexistent.gguf"):
        bench.benchmark([None, "/nonexistent.gguf"], options, lambda what, done: seen.append(what))
    assert seen == []
