"""`llmrun run --batch`: each result equals the same prompt run alone through `llmrun run`,
in input order or as they finish, resumable from its output file, bad lines reported by
number and skipped, Ctrl-C leaving only whole lines. The single runs and most batches go
through Typer's test runner, error lines and exit codes through llmrun's own entry point
(both in process, so no interpreter start each); a stdin pipe, a terminal, Ctrl-C and
kill -9 through real subprocesses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import STORY_PROMPTS
from in_process import llmrun as llmrun_in_process
from scripted import scripted_model_dir
from typer.testing import CliRunner

from llmrun.batch_run import BadLine, Line, done_ids, parse_line, read_lines
from llmrun.cli import app


def invoke(*args: str, input: str | None = None):
    result = CliRunner().invoke(app, list(args), input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def alone(prompt: str, *flags: str, model: str | None = None) -> dict:
    """`llmrun run --json` for one prompt, as a batch result line has it."""
    result = invoke("run", *([model] if model else []), prompt, "--json", *flags)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    del record["model"], record["timings"]
    return record


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def write_jsonl(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def llmrun(*args, input=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "llmrun", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_greedy_seeded_stop_and_format_lines_equal_single_runs(tmp_path):
    lines = [
        {"prompt": STORY_PROMPTS[0], "temperature": 0, "max_tokens": 40},
        {"id": "dog", "prompt": STORY_PROMPTS[1], "seed": 3, "temperature": 0.9, "max_tokens": 30},
        {"prompt": STORY_PROMPTS[2], "seed": 11, "max_tokens": 25},
        {"prompt": STORY_PROMPTS[3], "temperature": 0, "max_tokens": 60, "stop": ["bird", "tree"]},
        {"prompt": STORY_PROMPTS[4], "temperature": 0, "max_tokens": 20, "format": "json"},
        {"id": 7, "prompt": STORY_PROMPTS[5], "temperature": 0, "stop": "."},
    ]
    batch = invoke("run", "--batch", write_jsonl(tmp_path / "in.jsonl", lines), "--parallel", "3")
    assert batch.exit_code == 0, batch.output
    expected = [
        {"id": 1, **alone(STORY_PROMPTS[0], "--temperature", "0", "-n", "40")},
        {"id": "dog", **alone(STORY_PROMPTS[1], "--seed", "3", "--temperature", "0.9", "-n", "30")},
        {"id": 3, **alone(STORY_PROMPTS[2], "--seed", "11", "-n", "25")},
        {
            "id": 4,
            **alone(
                STORY_PROMPTS[3],
                "--temperature",
                "0",
                "-n",
                "60",
                "--stop",
                "bird",
                "--stop",
                "tree",
            ),
        },
        {"id": 5, **alone(STORY_PROMPTS[4], "--temperature", "0", "-n", "20", "--format", "json")},
        {"id": 7, **alone(STORY_PROMPTS[5], "--temperature", "0", "--stop", ".")},
    ]
    assert records(batch.stdout) == expected
    assert expected[3]["finish_reason"] == "stop" and expected[0]["finish_reason"] == "length"


def test_plain_lines_from_a_stdin_pipe_take_the_command_flags():
    # A real pipe into a real process: `-` reads stdin; a blank line is no prompt.
    flags = ("-n", "12", "--seed", "5", "--stop", "park")
    piped = "\n".join(STORY_PROMPTS[:4]) + "\n\n" + STORY_PROMPTS[4] + "\n"
    result = llmrun("run", "--batch", "-", "--batch-lines", *flags, input=piped)
    assert (result.returncode, result.stderr) == (0, "")
    ids = [1, 2, 3, 4, 6]  # line numbers
    prompts = STORY_PROMPTS[:5]
    expected = [{"id": i, **alone(p, *flags)} for i, p in zip(ids, prompts, strict=True)]
    assert records(result.stdout) == expected


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    script = ["<think>", "▁the", "▁big", "</think>", "▁Lily", "▁was", "▁happy"]
    return str(scripted_model_dir(tmp_path_factory.mktemp("thinker"), script))


def test_messages_go_through_the_chat_template_with_reasoning_apart(tmp_path, thinker):
    lines = [
        {"id": "a", "messages": [{"role": "user", "content": "Hi"}]},
        {"id": "b", "prompt": "Hi"},
    ]
    batch = invoke("run", thinker, "--batch", write_jsonl(tmp_path / "in.jsonl", lines))
    assert batch.exit_code == 0, batch.output
    single = alone("Hi", "--temperature", "0", model=thinker)
    assert (single["text"], single["reasoning"]) == ("Lily was happy", "the big")
    assert records(batch.stdout) == [{"id": "a", **single}, {"id": "b", **single}]


def test_messages_without_a_template_read_as_a_transcript(tmp_path):
    # stories260K has no template: chat's "User:/Assistant:" transcript, cut at "\nUser:".
    lines = [{"messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 0}]
    batch = invoke("run", "--batch", write_jsonl(tmp_path / "in.jsonl", lines), "-n", "30")
    expected = alone("User: Tell me a story\nAssistant:", "--temperature", "0", "-n", "30")
    (got,) = records(batch.stdout)
    assert got["text"] == expected["text"].lstrip().split("\nUser:")[0]
    assert got["prompt_tokens"] == expected["prompt_tokens"]


def test_bad_lines_are_reported_by_number_and_skipped(tmp_path):
    long_prompt = " ".join(["Once upon a time there was a cat."] * 10)
    lines = [
        {"id": "ok1", "prompt": STORY_PROMPTS[0], "max_tokens": 5},
        "{not json",
        {"prompt": STORY_PROMPTS[1], "temprature": 0},
        {"id": "ok1", "prompt": STORY_PROMPTS[2]},
        {"prompt": STORY_PROMPTS[1], "temperature": -1},
        {"prompt": long_prompt},
        [1, 2],
        {"id": "ok2", "prompt": STORY_PROMPTS[1], "max_tokens": 5},
        {"prompt": "x", "messages": []},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    flags = ("--temperature", "0", "-c", "48")
    result = llmrun_in_process("run", "--batch", path, *flags)
    assert result.returncode == 1
    assert [r["id"] for r in records(result.stdout)] == ["ok1", "ok2"]
    assert result.stderr.splitlines() == [
        "error: line 2: not JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))",
        "error: line 3: unknown field temprature (known: id, prompt, messages, temperature, "
        "top_k, top_p, min_p, seed, max_tokens, stop, format)",
        'error: line 4: the id "ok1" is already on line 1',
        "error: line 5: temperature must be >= 0, got -1",
        "error: line 6: the prompt is 101 tokens, but the context holds 48; shorten the prompt "
        "or raise --ctx-size",
        "error: line 7: must be a JSON object with a prompt or messages",
        "error: line 9: give either prompt or messages",
    ]
    strict = llmrun_in_process("run", "--batch", path, *flags, "--strict")
    assert (strict.returncode, strict.stdout) == (1, "")
    assert strict.stderr == result.stderr.splitlines(keepends=True)[0]


def test_order_is_the_input_order_unless_unordered(tmp_path):
    # The first request runs far longer than the second, batched beside it.
    lines = [
        {"prompt": STORY_PROMPTS[4], "temperature": 0, "max_tokens": 120},
        {"prompt": STORY_PROMPTS[1], "temperature": 0, "max_tokens": 2},
        {"prompt": STORY_PROMPTS[2], "temperature": 0, "max_tokens": 3},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    ordered = records(invoke("run", "--batch", path, "--parallel", "3").stdout)
    unordered = records(invoke("run", "--batch", path, "--parallel", "3", "--unordered").stdout)
    assert [r["id"] for r in ordered] == [1, 2, 3]
    assert ordered[0]["completion_tokens"] == 120
    assert [r["id"] for r in unordered] == [2, 3, 1]
    assert sorted(unordered, key=lambda r: r["id"]) == ordered


def test_resume_skips_the_ids_already_written_and_drops_a_torn_line(tmp_path):
    lines = [{"prompt": p, "temperature": 0, "max_tokens": 8} for p in STORY_PROMPTS]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    full = tmp_path / "full.jsonl"
    assert invoke("run", "--batch", path, "-o", str(full)).exit_code == 0
    written = full.read_text().splitlines(keepends=True)
    assert len(written) == len(STORY_PROMPTS)
    partial = tmp_path / "partial.jsonl"
    partial.write_text(written[0] + written[2] + written[3][:20])  # as if killed mid-write
    result = invoke("run", "--batch", path, "-o", str(partial), "--resume")
    assert (result.exit_code, result.stdout) == (0, "")
    resumed = partial.read_text().splitlines(keepends=True)
    assert resumed == [written[0], written[2], written[1], *written[3:]]
    # Nothing left to do: the file stays as it is.
    assert invoke("run", "--batch", path, "-o", str(partial), "--resume").exit_code == 0
    assert partial.read_text().splitlines(keepends=True) == resumed


@pytest.mark.parametrize("text", ["my notes\nsecond line without newline", "one line, no newline"])
def test_resume_leaves_a_file_that_is_not_results_alone(tmp_path, text):
    """-o FILE --resume with the wrong FILE: refused before anything is cut from it."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Once", "max_tokens": 2}])
    notes = tmp_path / "notes.txt"
    notes.write_text(text)
    result = CliRunner().invoke(app, ["run", "--batch", path, "-o", str(notes), "--resume"])
    assert "line 1 is not a result line" in str(result.exception)
    assert notes.read_text() == text


def test_ctrl_c_leaves_whole_lines_that_resume_completes(tmp_path):
    lines = [{"prompt": p, "temperature": 0, "max_tokens": 150} for p in STORY_PROMPTS * 2]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "llmrun", "run", "--batch", path, "--parallel", "2"]
    process = subprocess.Popen([*args, "-o", str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 130
    process.stderr.close()
    data = out.read_bytes()
    assert data.endswith(b"\n") and 2 <= data.count(b"\n") < len(lines)
    done = records(data.decode())  # every line is whole JSON
    assert [r["id"] for r in done] == list(range(1, len(done) + 1))
    assert llmrun_in_process("run", "--batch", path, "-o", str(out), "--resume").returncode == 0
    everything = llmrun_in_process("run", "--batch", path, "--parallel", "2", "--verbose")
    assert records(out.read_text()) == records(everything.stdout)
    # In a pipe, --verbose gives stderr the summary (and nothing styled).
    summary = everything.stderr.splitlines()[-1]
    assert summary.startswith(f"{len(lines)} prompts, ") and summary.endswith(" tokens/s")
    assert "\x1b[" not in everything.stderr


def test_a_killed_run_leaves_whole_lines_that_resume_completes(tmp_path):
    """SIGKILL gives no chance to clean up: what the file holds is whole lines all the
    same (each is written with one flushed write), and --resume makes the same file, in
    another order, as a run that was never killed (greedy and seeded lines)."""
    lines = [
        {"prompt": p, "max_tokens": 150, **({"temperature": 0} if i % 2 else {"seed": i})}
        for i, p in enumerate(STORY_PROMPTS * 2)
    ]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "llmrun", "run", "--batch", path, "--parallel", "2"]
    process = subprocess.Popen([*args, "-o", str(out)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    process.kill()
    assert process.wait(60) == -signal.SIGKILL
    killed = records(out.read_text())  # every line is whole JSON
    assert 2 <= len(killed) < len(lines)
    assert llmrun_in_process("run", "--batch", path, "-o", str(out), "--resume").returncode == 0
    everything = records(invoke("run", "--batch", path).stdout)
    resumed = records(out.read_text())
    assert resumed[: len(killed)] == killed
    assert sorted(resumed, key=lambda r: r["id"]) == everything


def test_a_terminal_gets_a_progress_bar(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    lines = [{"prompt": p, "temperature": 0, "max_tokens": 100} for p in STORY_PROMPTS * 2]
    out = tmp_path / "out.jsonl"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "llmrun", "run", "--batch", write_jsonl(tmp_path / "in.jsonl", lines)]
        + ["-o", str(out), "--parallel", "2"],
        env=dict(os.environ),
        encoding="utf-8",
        timeout=120,
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert f"/{len(lines)}" in child.before and "tokens/s" in child.before
    assert len(records(out.read_text())) == len(lines)


def test_usage_errors_are_one_line():
    for args, message in [
        (["run", "hi", "--unordered"], "error: --unordered goes with --batch\n"),
        (["run", "--batch", "x.jsonl", "--resume"], "error: --resume needs -o FILE"),
        (["run", "--batch", "no-such.jsonl"], "error: --batch no-such.jsonl: No such file"),
        (["run", "--batch", "x.jsonl", "--json"], "error: --json does not go with --batch"),
    ]:
        result = llmrun_in_process(*args)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


def test_an_output_that_cannot_be_written_is_the_only_error(tmp_path):
    """-o into a missing folder was found after the model loaded and every line was
    read: an error line for each bad line came first."""
    path = write_jsonl(tmp_path / "in.jsonl", ["not json", {"prompt": "Once"}])
    out = tmp_path / "missing" / "out.jsonl"
    result = llmrun_in_process("run", "--batch", path, "-o", str(out))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"error: -o {out}: No such file or directory\n"
    assert (
        llmrun_in_process("run", "--batch", path, "-o", str(tmp_path / "new.jsonl")).returncode == 1
    )
    assert len(records((tmp_path / "new.jsonl").read_text())) == 1


# ---- the library's pieces, without a model -----------------------------------------------


def test_lines_are_checked_field_by_field():
    assert parse_line(3, '{"prompt": "hi", "stop": "x", "max_tokens": -1}') == Line(
        3, 3, prompt="hi", stop=["x"], has_max_tokens=True
    )
    for text, message in [
        ('{"prompt": "hi", "id": true}', "id must be a string or an integer"),
        ('{"prompt": ""}', "prompt must be a non-empty string"),
        ('{"prompt": "hi", "seed": 1.5}', "seed must be an integer"),
        ('{"prompt": "hi", "max_tokens": -2}', "max_tokens must be an integer >= -1"),
        ('{"prompt": "hi", "stop": [1]}', "stop must be a string or a list of strings"),
        ('{"prompt": "hi", "format": "yaml"}', 'format must be "json" or a JSON schema'),
        ('{"messages": [{"content": "hi"}]}', r"messages\[0\] must be an object with a role"),
    ]:
        with pytest.raises(BadLine, match=f"^line 5: {message}"):
            parse_line(5, text)


def test_plain_lines_skip_blanks_and_report_bad_utf8():
    got = list(read_lines(b"a\r\n\n  \n\xff\nb", plain=True))
    assert [(x.number, x.prompt) for x in got if isinstance(x, Line)] == [(1, "a"), (5, "b")]
    (bad,) = [x for x in got if isinstance(x, BadLine)]
    assert str(bad) == "line 4: not UTF-8 text (invalid start byte at byte 0)"


def test_done_ids_refuses_a_file_that_is_not_results(tmp_path):
    path = tmp_path / "out.jsonl"
    assert done_ids(path) == set()
    path.write_text('{"id": 1}\n{"id": "1"}\n')
    assert done_ids(path) == {"1", '"1"'}
    path.write_text('{"id": 1}\nhello\n')
    with pytest.raises(Exception, match="line 2 is not a result line"):
        done_ids(path)
    assert os.path.getsize(path) == len('{"id": 1}\nhello\n')


@pytest.mark.parametrize("torn", [b"{", b'{"i', b'{"id": ', b'{"id": 2, "te'])
def test_done_ids_drops_a_line_torn_anywhere(tmp_path, torn):
    """A result line cut before its id was whole (`{"i`) was taken for a file that is
    not results, and --resume refused to go on."""
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 1}\n' + torn)
    assert done_ids(path) == {"1"}
    assert path.read_bytes() == b'{"id": 1}\n'
