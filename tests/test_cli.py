"""The CLI as a user sees it: pipes, exit codes, JSON. Through real subprocesses where
the process itself is under test (the default model's story end to end, piped stdin,
plain text in pipes, a closed or full stdout, Ctrl-C, what --help imports, --debug's
traceback); the rest in process (tests/in_process.py), which saves an interpreter start
and a torch import each."""

import ast
import inspect
import json
import os
import platform
import signal
import subprocess
import sys
import time

import pytest
from helpers import STORIES_GGUF, STORIES_HF, VOCAB_DIR, needs_vocab, tiny_hf_model, write_gguf
from in_process import llmrun as llmrun_in_process

# The first 100 greedy tokens after "Once upon a time": llama2.c's run.c, llama.cpp and
# transformers agree on them (tests/data/README.md).
STORY = (
    ", there was a little girl named Lily. She loved to play outside in the park. One day, "
    "she saw a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do"
)


def llmrun(*args, input=None, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "llmrun", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "LLMRUN_HOME": os.environ["LLMRUN_HOME"],
            **(env or {}),
        },
    )


def test_default_model_tells_the_known_story():
    result = llmrun("run", "Once upon a time", "-n", "100", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == STORY
    assert result.stderr == ""


def test_prompt_from_stdin_and_argument_plus_stdin():
    piped = llmrun_in_process("run", "-n", "20", "--temperature", "0", input="Once upon a time\n")
    argument = llmrun_in_process("run", "Once upon a time", "-n", "20", "--temperature", "0")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == argument.stdout
    both = llmrun_in_process(
        "run",
        "Once upon",
        "-n",
        "5",
        "--temperature",
        "0",
        "--show-prompt",
        "--raw",
        input="a time\n",
    )
    assert both.returncode == 0, both.stderr
    assert both.stderr.startswith("Once upon\n\na time\n")


def test_pipes_get_plain_text_and_verbose_stats_go_to_stderr():
    result = llmrun_in_process("run", "Once upon a time", "-n", "10", "--temperature", "0", "-v")
    assert result.returncode == 0
    assert "\x1b[" not in result.stdout + result.stderr
    assert result.stdout == STORY[: len(result.stdout)]
    assert "tokens/s" in result.stderr and "prompt: 5 tokens" in result.stderr


def test_same_seed_same_text():
    """In two processes: this one and a fresh one."""
    args = ("run", "Once upon a time", "-n", "30", "--seed", "7")
    runs = [llmrun(*args).stdout, llmrun_in_process(*args).stdout]
    assert runs[0] == runs[1]
    other = llmrun_in_process("run", "Once upon a time", "-n", "30", "--seed", "8").stdout
    assert other != runs[0]


def test_json_output_and_logprobs():
    result = llmrun_in_process(
        "run", "Once upon a time", "-n", "8", "--temperature", "0", "--json", "--logprobs", "3"
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["text"] == STORY[: len(data["text"])]
    assert data["finish_reason"] == "length"
    assert data["prompt_tokens"] == 5 and data["completion_tokens"] == 8
    assert set(data["timings"]) >= {"prompt_tokens_per_second", "generation_tokens_per_second"}
    assert len(data["logprobs"]) == 8
    for entry in data["logprobs"]:
        top = entry["top_logprobs"]
        assert len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert top[0]["id"] == entry["id"] and top[0]["logprob"] == pytest.approx(entry["logprob"])
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert bytes(entry["bytes"]).decode() == entry["token"]  # OpenAI's shape: UTF-8 bytes too


def test_stop_string_cuts_the_text():
    result = llmrun_in_process(
        "run", "Once upon a time", "-n", "100", "--temperature", "0", "--stop", "Lily", "--json"
    )
    data = json.loads(result.stdout)
    assert data["text"] == ", there was a little girl named "
    assert data["finish_reason"] == "stop"


def test_hf_directory_model():
    result = llmrun_in_process(
        "run",
        str(STORIES_HF),
        "Once upon a time",
        "-n",
        "100",
        "--temperature",
        "0",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == STORY


def test_prompt_longer_than_context_is_an_error():
    result = llmrun_in_process("run", "Once upon a time " * 20, "--ctx-size", "16")
    assert result.returncode == 1
    assert result.stderr.startswith("error: the prompt is 82 tokens, but the context holds 16")


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["run", "/no/such/model.gguf", "hi"], 1, "error: /no/such/model.gguf: no such file"),
        (["run", "hi", "--temperature", "-1"], 2, "error: temperature must be >= 0"),
        (["run", "hi", "--top-p", "1.5"], 2, "error: top-p must be in (0, 1]"),
        (["run", "hi", "--top-p", "0"], 2, "error: top-p must be in (0, 1]"),
        (["run", "hi", "--device", "tpu"], 2, "error: unknown device 'tpu'"),
        (["run", "hi", "--dtype", "f8"], 2, "error: unknown dtype 'f8'"),
        (["run", "hi", "--no-such-flag"], 2, "error: no such option: --no-such-flag"),
        (["run", "hi", "-n", "many"], 2, "error: invalid value for '--max-tokens' / '-n'"),
        (["run", "hi", "--logprobs", "2"], 2, "error: --logprobs needs --json"),
        (["run", "hi", "--temperature", "nan"], 2, "error: temperature must be >= 0"),
        (["run", "hi", "--repeat-penalty", "nan"], 2, "error: repeat-penalty must be > 0"),
        (["run", "hi", "-c", "999999999"], 2, "error: a KV cache of 999999999 tokens takes"),
        (["rm", "-y", "stories260K"], 2, "error: stories260K is a local model, not a downloaded"),
    ],
)
def test_bad_input_is_one_error_line(args, code, message):
    result = llmrun_in_process(*args)
    assert result.returncode == code
    assert result.stderr.startswith(message), result.stderr
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_corrupt_and_unsupported_models(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(STORIES_GGUF.read_bytes()[:300_000])
    no_config = tmp_path / "empty_dir"
    no_config.mkdir()
    for path, message in [
        (truncated, "past the end of the file"),
        (no_config, "no config.json"),
    ]:
        result = llmrun_in_process("run", str(path), "hi")
        assert result.returncode == 1
        assert result.stderr.startswith("error: ") and message in result.stderr
        assert result.stderr.count("\n") == 1
    debug = llmrun("run", str(truncated), "hi", "--debug")
    assert "Traceback" in debug.stderr


def test_head_counts_that_do_not_fit_are_one_error_line(tmp_path):
    """Corrupt metadata (a head count of 0, or one that does not divide) was a
    ZeroDivisionError or a reshape traceback."""
    import gguf

    hf, config = tiny_hf_model("llama")
    good = write_gguf(tmp_path / "good.gguf", config, hf.state_dict())
    for key, value, message in [
        ("llama.attention.head_count", 0, "num_attention_heads is 0, not a positive whole number"),
        ("llama.attention.head_count_kv", 3, "attention heads cannot share 3 key/value heads"),
    ]:
        field = gguf.GGUFReader(good).fields[key]  # its value: the last of its parts
        at = field.offset + sum(part.nbytes for part in field.parts[:-1])
        data = bytearray(good.read_bytes())
        data[at : at + 4] = value.to_bytes(4, "little")
        path = tmp_path / f"{value}.gguf"
        path.write_bytes(data)
        result = llmrun_in_process("run", str(path), "hi")
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert message in result.stderr
    model_dir = tmp_path / "hf"
    hf.save_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "hidden_size": "64"}))
    result = llmrun_in_process("run", str(model_dir), "hi")
    assert (
        result.returncode == 1
        and "hidden_size is '64', not a positive whole number" in result.stderr
    )


def test_text_that_is_not_utf8_is_read_with_replacements(tmp_path):
    """Bytes that are not UTF-8 (stdin, argv, a lone surrogate in a batch line) reach the
    tokenizer as U+FFFD, as a terminal shows them; it was a TypeError traceback."""
    env = {**os.environ, "LLMRUN_HOME": os.environ["LLMRUN_HOME"]}
    command = [sys.executable, "-m", "llmrun"]
    piped = subprocess.run(
        [*command, "run", "-n", "3", "--temperature", "0", "--json"],
        input=b"a\xffb",
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    replaced = llmrun_in_process("run", "a\ufffdb", "-n", "3", "--temperature", "0", "--json")
    assert json.loads(piped.stdout)["text"] == json.loads(replaced.stdout)["text"]
    tokens = subprocess.run(
        [*command, "tokenize", "--batch"], input=b"a\xffb\n", capture_output=True, env=env
    )
    assert (
        tokens.returncode == 0
        and tokens.stdout == llmrun_in_process("tokenize", "a\ufffdb").stdout.encode()
    )
    lines = tmp_path / "b.jsonl"
    lines.write_text('{"prompt": "hi \\ud800 there"}\n')
    batch = llmrun_in_process("run", "--batch", str(lines), "-n", "2")
    assert batch.returncode == 0, batch.stderr


def test_files_that_are_not_utf8_are_one_error_line(tmp_path):
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe")
    for flag in ("--template", "--grammar"):
        result = llmrun_in_process("run", "hi", flag, str(binary))
        assert (
            result.returncode == 2 and result.stderr == f"error: {flag} {binary}: not UTF-8 text\n"
        )


def test_output_that_cannot_be_written(tmp_path):
    """A full disk or a closed stdout: one error line; a reader that leaves (`| head`)
    is no error at all (typer exited 1 there)."""
    command = [sys.executable, "-m", "llmrun"]
    for args in (["run", "hi", "-n", "3"], ["run", "hi", "-n", "3", "--json"], ["tokenize", "hi"]):
        with open("/dev/full", "w") as full:
            result = subprocess.run(
                [*command, *args], stdout=full, stderr=subprocess.PIPE, text=True
            )
        assert result.returncode == 1
        assert result.stderr == "error: cannot write the output: No space left on device\n"
    closed = subprocess.run(
        [*command, "run", "hi"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        pass_fds=(),
        preexec_fn=lambda: os.close(1),
    )
    assert (closed.returncode, closed.stderr) == (1, "error: standard output is closed\n")
    proc = subprocess.Popen(
        [*command, "run", "Once upon a time", "-n", "300", "-t", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.read(5)
    proc.stdout.close()  # `| head -c 5`
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""


def test_unknown_architecture(tmp_path):
    hf, config = tiny_hf_model("llama")
    model_dir = tmp_path / "m"
    hf.save_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "rwkv5"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    result = llmrun_in_process("run", str(model_dir), "hi")
    assert result.returncode == 1
    from llmrun.models import ARCHITECTURES

    supported = ", ".join(sorted(ARCHITECTURES))
    assert f"error: architecture 'rwkv5' is not supported (supported: {supported})" in result.stderr
    assert {"llama", "qwen3", "gemma3", "qwen3_moe", "gpt_oss"} <= set(ARCHITECTURES)


def test_missing_tokenizer(tmp_path):
    hf, config = tiny_hf_model("llama")
    model_dir = tmp_path / "m"
    hf.save_pretrained(model_dir)
    result = llmrun_in_process("run", str(model_dir), "hi")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "tokenizer" in result.stderr


def test_random_gguf_model_runs(tmp_path):
    hf, config = tiny_hf_model("qwen2")
    path = write_gguf(tmp_path / "qwen2.gguf", config, hf.state_dict())
    result = llmrun_in_process("run", str(path), "Once upon a time", "-n", "5", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["completion_tokens"] == 5


def test_ctrl_c_exits_130():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmrun",
            "run",
            "Once upon a time",
            "-n",
            "-1",
            "--ctx-size",
            "2048",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.read(20)  # generation has started
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    code = proc.wait(timeout=30)
    assert code == 130
    assert time.monotonic() - start < 5
    assert "Traceback" not in proc.stderr.read()


def test_help_does_not_import_torch():
    """Nor mistral_common, which gguf imports with itself where it is installed (~0.8 s
    of every command's start-up) for a vocabulary class llmrun does not use; and the
    cyclic GC looks less often than Python's default (~0.2 s of torch's import)."""
    code = "import sys; sys.argv = ['llmrun', '--help']\nfrom llmrun.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\nassert 'gguf' in sys.modules and 'mistral_common' not in sys.modules, 'mistral_common imported'\nimport gc\nassert gc.get_threshold()[0] >= 50_000, gc.get_threshold()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "run" in result.stdout and "tokenize" in result.stdout


def test_command_signatures_hold_their_types_not_strings():
    """typer reads every command's signature at each start; postponed annotations
    (`from __future__ import annotations`) made it compile and evaluate ~450 strings
    each time, 70 of the 94 ms it took to build the command line."""
    from llmrun.cli import app

    callbacks = [command.callback for command in app.registered_commands]
    assert len(callbacks) > 10
    for callback in [*callbacks, app.registered_callback.callback]:
        for parameter in inspect.signature(callback).parameters.values():
            assert not isinstance(parameter.annotation, str), (callback.__name__, parameter)


_REUSE_AFTER_MAIN = """
import ctypes, resource, sys
sys.argv = ['llmrun', '--help']
from llmrun.cli import main
try:
    main()
except SystemExit:
    pass
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(20 << 20)
    libc.memset(block, 1, 20 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_temporaries_are_reused_not_faulted_in_again():
    """A prompt's GEMM tiles and activations (up to 16 MB each) are freed and taken again
    layer after layer; with glibc's defaults a process could page-fault ~800 MB of
    fresh pages a 512-token prompt. After the command line's set-up, the second 20 MB
    block reuses the first one's pages (with glibc's defaults it is mapped anew)."""
    result = subprocess.run(
        [sys.executable, "-c", _REUSE_AFTER_MAIN], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    first, *later = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert first > 4000  # 20 MB of 4 KB pages: the faults are counted
    assert max(later) < 100, later


@needs_vocab
def test_tokenize_vocab_only_gguf():
    vocab = VOCAB_DIR / "ggml-vocab-llama-bpe.gguf"
    result = llmrun_in_process("tokenize", str(vocab), "Hello world")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [128000, 9906, 1917]
    no_bos = llmrun_in_process("tokenize", str(vocab), "Hello world", "--no-bos")
    assert json.loads(no_bos.stdout) == [9906, 1917]
    pieces = llmrun_in_process("tokenize", str(vocab), "--pieces", "--no-bos", input="Hello world")
    assert [json.loads(line) for line in pieces.stdout.splitlines()] == [
        {"id": 9906, "piece": "Hello"},
        {"id": 1917, "piece": " world"},
    ]
    special = llmrun_in_process("tokenize", str(vocab), "<|eot_id|>", "--no-bos")
    plain = llmrun_in_process("tokenize", str(vocab), "<|eot_id|>", "--no-bos", "--no-special")
    assert json.loads(special.stdout) == [128009]
    assert len(json.loads(plain.stdout)) > 1


def test_tokenize_default_model():
    result = llmrun_in_process("tokenize", "Once upon a time")
    assert json.loads(result.stdout) == [1, 403, 407, 261, 378]


@pytest.mark.parametrize(
    "command,named", [("show", "MODEL"), ("pull", "REPO[:QUANT]"), ("rm", "MODEL")]
)
def test_a_missing_argument_is_named_as_the_help_names_it(command, named):
    result = llmrun_in_process(command)
    assert (result.returncode, result.stderr) == (2, f"error: missing argument '{named}'.\n")
    assert named in llmrun_in_process(command, "--help").stdout


def test_counts_that_round_to_1000_take_the_next_unit():
    """Three digits that round up to 1000 printed '1e+03K' in show, list and bench."""
    from llmrun.ui import count

    got = [count(n) for n in (912, 292_800, 999_499, 999_950, 999_999_999, 1_235_814_400)]
    assert got == ["912", "293K", "999K", "1M", "1B", "1.24B"]


def test_list_on_a_narrow_terminal_shows_whole_names(monkeypatch, capsys):
    """Rich cut a long name short ('org/a-very-l…'), so two quants of one repo looked
    the same and neither could be copied into `run`; the name now folds instead."""
    from types import SimpleNamespace

    from llmrun import ui

    names = [
        f"some-organisation/a-very-long-model-name-Instruct-GGUF:{q}" for q in ("Q4_K_M", "Q8_0")
    ]
    row = dict(format="gguf", quant="Q4_K_M", parameters=7_615_616_512, size=4.7e9)
    models = [SimpleNamespace(name=n, last_used=None, source="llmrun", **row) for n in names]
    monkeypatch.setattr(ui, "stdout_is_tty", lambda: True)
    monkeypatch.setenv("COLUMNS", "80")
    ui.print_models(models)
    name_column = [line.split("  ")[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert "".join(name_column) == "".join(names)
