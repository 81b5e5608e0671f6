"""`llmrun chat` driven as a user would: in a pseudo-terminal, and through a pipe."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from helpers import chat_model_dir, needs_templates
from in_process import llmrun as llmrun_in_process

PROMPT = ">>> "


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("repl") / "m", context=4096)


@pytest.fixture
def home(tmp_path):
    """A home of its own (the REPL's history), sharing the session's built kernels:
    building them again took each test half a minute."""
    kernels = Path(os.environ["LLMRUN_HOME"]) / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "kernels").symlink_to(kernels)
    return tmp_path / "home"


def spawn(home, *args, command="chat"):
    env = {**os.environ, "LLMRUN_HOME": str(home), "TERM": "dumb", "COLUMNS": "200"}
    child = pexpect.spawn(
        sys.executable, ["-m", "llmrun", command, *args], env=env, encoding="utf-8", timeout=90
    )
    child.expect_exact(PROMPT)
    return child


def test_multi_turn_commands_and_ctrl_d(home, tmp_path):
    child = spawn(home, "-n", "12", "--temperature", "0")
    child.sendline("Once upon a time")
    child.expect_exact(PROMPT)
    first_reply = child.before
    child.sendline("/show")
    child.expect("context: (\\d+)/2048 tokens")
    assert int(child.match.group(1)) > 5
    child.expect_exact(PROMPT)
    child.sendline("/set temperature 0.7")
    child.expect_exact("temperature = 0.7")
    child.expect_exact(PROMPT)
    child.sendline("/set warmth 3")
    child.expect_exact("unknown parameter 'warmth'")
    child.expect_exact(PROMPT)
    child.sendline("/system Tell short stories.")
    child.expect_exact("system message set")
    child.expect_exact(PROMPT)
    child.sendline("/set temperature 0")
    child.expect_exact(PROMPT)
    child.sendline("/retry")
    child.expect_exact(PROMPT)
    child.sendline(f"/save {tmp_path / 'conv.json'}")
    child.expect_exact("saved 2 messages")
    child.expect_exact(PROMPT)
    child.sendline("/undo")
    child.expect_exact("dropped the last exchange")
    child.expect_exact(PROMPT)
    child.sendline("/clear")
    child.expect_exact("new conversation")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {tmp_path / 'conv.json'}")
    child.expect_exact("loaded 2 messages")
    child.expect_exact(PROMPT)
    child.sendline("/frobnicate")
    child.expect_exact("unknown command /frobnicate; /help lists the commands")
    child.expect_exact(PROMPT)
    child.sendline("/help")
    child.expect_exact("/retry")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert first_reply.strip()


def test_multiline_input_and_history_across_sessions(home):
    child = spawn(home, "-n", "4", "--temperature", "0")
    child.sendline('"""Once upon')
    child.expect_exact("... ")
    child.sendline('a time"""')
    child.expect_exact(PROMPT)
    child.sendline("/show")
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    again = spawn(home, "-n", "4", "--temperature", "0")
    again.send("\x1b[A")  # up arrow: the last line of the previous session
    again.expect_exact("/bye")
    again.send("\x1b[A")
    again.expect_exact("show")  # readline redraws only what differs from "/bye"
    again.sendline("")
    again.expect("context: \\d+/2048")
    again.expect_exact(PROMPT)
    again.sendline("/exit")
    again.expect(pexpect.EOF)


@needs_templates
def test_ctrl_c_stops_a_reply_keeps_it_and_the_session_goes_on(home, chat_model):
    child = spawn(home, str(chat_model), "-n", "-1", "--temperature", "1", "--seed", "3")
    child.sendline("Write forever")
    child.expect(".{40}")  # the reply is streaming
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    child.sendline("/show")
    child.expect("context: (\\d+)/4096")
    used = int(child.match.group(1))
    assert 40 < used < 4000
    child.expect_exact(PROMPT)
    child.sendline("/set max_tokens 3")
    child.expect_exact(PROMPT)
    child.sendline("And now?")
    child.expect_exact(PROMPT)
    child.sendintr()  # Ctrl-C at an empty prompt: a hint, not an exit
    child.expect_exact("Use Ctrl-D or /bye to exit.")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@needs_templates
def test_template_model_multi_turn(home, chat_model):
    child = spawn(home, str(chat_model), "-n", "5", "--temperature", "0", "--verbose")
    child.sendline("Hello")
    child.expect("prompt: (\\d+) tokens \\((\\d+) processed\\)")
    assert child.match.group(1) == child.match.group(2)
    child.expect_exact(PROMPT)
    child.sendline("Again")
    child.expect("prompt: (\\d+) tokens \\((\\d+) processed\\)")
    total, processed = int(child.match.group(1)), int(child.match.group(2))
    assert processed < total / 2  # only the new turn is prefilled
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)


def test_piped_chat_has_exact_greedy_output():
    result = llmrun_in_process(
        "chat", "-n", "20", "--temperature", "0", input="Once upon a time\nWhat did Lily do?\n"
    )
    assert result.returncode == 0, result.stderr
    replies = result.stdout.split("\n\n")
    assert len(replies) == 3 and replies[2] == ""
    # Each reply equals a fresh greedy generation after the whole transcript so far.
    from llmrun import api
    from llmrun.chat_template import plain_transcript
    from llmrun.sampling import SamplingParams

    engine = api.load(None, device="cpu")
    messages = []
    for user, expected in zip(["Once upon a time", "What did Lily do?"], replies[:2], strict=True):
        messages.append({"role": "user", "content": user})
        ids = engine.tokenizer.encode(plain_transcript(messages))
        text = "".join(
            r.text
            for r in engine.generate(ids, SamplingParams(temperature=0), 20, stop=["\nUser:"])
        )
        assert expected == text.strip()
        messages.append({"role": "assistant", "content": expected})
    assert "no chat template" in result.stderr


def test_piped_chat_reads_lines_ending_in_crlf(home):
    """A file written on Windows: /bye still ends the session, and no \\r reaches a message."""
    env = {**os.environ, "LLMRUN_HOME": str(home)}
    run = [sys.executable, "-m", "llmrun", "chat", "-n", "5", "--temperature", "0"]
    crlf = subprocess.run(
        run, input="Once upon a time\r\n/bye\r\nafter\r\n", capture_output=True, text=True,
        env=env, timeout=120,
    )  # fmt: skip
    lf = llmrun_in_process(*run[3:], input="Once upon a time\n")
    assert crlf.returncode == 0 and "unknown command" not in crlf.stderr
    assert crlf.stdout == lf.stdout


def test_run_without_a_prompt_at_a_terminal_chats(home):
    """`llmrun run [MODEL]` (here the bundled one) with no prompt at a terminal opens the chat REPL, as
    `ollama run MODEL` does (it was an error); its options carry over."""
    child = spawn(home, "-n", "5", "--temperature", "0", command="run")
    child.sendline("/show")
    child.expect_exact("parameters: temperature=0.0")
    child.expect_exact("max_tokens=5")
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def answer(child, line: str) -> list[str]:
    """What the REPL prints for one input line, up to the next prompt (the echo left out)."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    return child.before.splitlines()[1:]


def test_set_refuses_bad_values_and_minus_one_means_what_the_flags_mean(home):
    """`/set max_tokens -7` was taken as no limit, `/set seed -1` as the fixed seed -1
    (shown as seed=None); the flags refuse the first and read the second as random."""
    child = spawn(home, "-n", "5", "--seed", "7")
    assert answer(child, "/set max_tokens -7") == [
        "error: max_tokens must be >= -1 (-1: no limit), got -7"
    ]
    assert answer(child, "/set seed many") == ["error: seed needs an integer, got 'many'"]
    assert answer(child, "/set top_p 2") == ["error: top-p must be in (0, 1], got 2.0"]
    assert answer(child, "/set seed -1") == ["seed = -1"]
    assert answer(child, "/show")[-1].endswith(" seed=-1 max_tokens=5")
    child.sendline("/bye")
    child.expect(pexpect.EOF)


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(home):
    """It said to /clear or use --context-overflow shift, neither of which helps (and
    shift dropped the whole history before refusing the message)."""
    child = spawn(home, "-n", "5", "--temperature", "0", "--context-overflow", "shift")
    assert answer(child, "Once upon a time")[0]  # a reply
    context = answer(child, "/show")[-2]
    # The line's echo wraps on the terminal: the error is the last line before the prompt.
    assert answer(child, "Once upon a time there was a cat. " * 300)[-1] == (
        "error: the message needs 3016 tokens plus room for a reply, but the context holds "
        "2048: shorten it, or use a larger --ctx-size"
    )
    assert answer(child, "/show")[-2] == context  # the conversation as it was
    assert answer(child, "The end")[0]
    child.sendline("/bye")
    child.expect(pexpect.EOF)


def test_a_ctrl_c_just_after_a_reply_leaves_the_repl_running(monkeypatch):
    """A Ctrl-C that lands after the reply's last token (here in --verbose's stats line)
    ended the REPL with exit status 130; it goes on to the next prompt."""
    from llmrun import api, ui
    from llmrun.chat import ChatSession
    from llmrun.repl import Repl
    from llmrun.sampling import SamplingParams

    session = ChatSession(api.load(None, device="cpu"), SamplingParams(temperature=0), 3)
    lines = iter(["Once upon a time", "The end", "/bye"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    monkeypatch.setattr("llmrun.repl._setup_readline", lambda: None)
    shown = []

    def print_stats(stats):
        shown.append(stats)
        if len(shown) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(ui, "print_stats", print_stats)
    Repl(session, interactive=True, verbose=True).run()
    assert len(shown) == 2
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2


def test_a_multiline_message_that_begins_with_a_slash_is_a_message(home, tmp_path):
    """Between \"\"\" lines everything is the message, as in ollama; a pasted path at its
    start made it an unknown command."""
    child = spawn(home, "-n", "3", "--temperature", "0")
    child.sendline('"""/usr/lib/libfoo.so is missing.')
    child.expect_exact("... ")
    assert "unknown command" not in "".join(answer(child, 'What now?"""'))
    assert answer(child, f"/save {tmp_path / 'c.json'}")[-1] == (
        f"saved 2 messages to {tmp_path / 'c.json'}"
    )
    saved = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert saved[0] == {"role": "user", "content": "/usr/lib/libfoo.so is missing.\nWhat now?"}
    child.sendline("/bye")
    child.expect(pexpect.EOF)


def test_a_full_context_under_shift_gives_no_clear_advice(home):
    """With --context-overflow shift the next turn drops the oldest messages itself;
    the warnings still said to /clear."""
    child = spawn(home, "-c", "64", "--temperature", "0", "--context-overflow", "shift")
    assert answer(child, "Once upon a time")[-1:] == [
        "warning: the context is full: the reply stops here"
    ]
    assert answer(child, "Then what?")[-2:] == [
        "warning: the context was full: dropped the 2 oldest messages",
        "warning: the context is full: the reply stops here",
    ]
    child.sendline("/bye")
    child.expect(pexpect.EOF)
