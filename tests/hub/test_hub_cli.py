"""`llmrun pull`, `list`, `show` and `rm` as a user runs them: output, exit codes, Ctrl-C.
Ctrl-C and the terminal's question go to real processes; the rest runs in process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from hubkit import GGUF_REPO, ST_PULLED, ST_REPO, cache, wait_for_part
from in_process import llmrun


def test_cli_pull_list_show_rm(fake, gguf_files, st_files):
    q8 = len(gguf_files["tiny-Q8_0.gguf"])
    st = sum(len(st_files[n]) for n in ST_PULLED)
    r = llmrun("pull", f"{GGUF_REPO}:Q8_0")
    assert (r.returncode, r.stderr) == (
        0,
        f"downloading 1 file(s), {q8 / 1000:.1f} kB\ndownloaded tiny-Q8_0.gguf\n",
    )
    assert Path(r.stdout.strip()).read_bytes() == gguf_files["tiny-Q8_0.gguf"]
    r = llmrun("pull", ST_REPO)
    assert r.returncode == 0 and r.stderr.startswith("downloading 6 file(s), ")
    r = llmrun("list")
    assert [line.split() for line in r.stdout.splitlines()] == [
        ["NAME", "FORMAT", "QUANT", "PARAMS", "SIZE", "LAST", "USED", "CACHE"],
        [f"{GGUF_REPO}:Q8_0", "gguf", "Q8_0", "2.05K", f"{q8 / 1000:.1f}", "kB", "never", "llmrun"],
        [ST_REPO, "safetensors", "F16", "912", f"{st / 1000:.1f}", "kB", "never", "llmrun"],
    ]
    rows = json.loads(llmrun("list", "--json").stdout)
    assert [(m["name"], m["size"], m["last_used"], m["source"]) for m in rows] == [
        (f"{GGUF_REPO}:Q8_0", q8, None, "llmrun"),
        (ST_REPO, st, None, "llmrun"),
    ]
    r = llmrun("show", ST_REPO)
    assert r.stdout.splitlines()[:10] == [
        f"name           {ST_REPO}",
        "format         safetensors",
        "architecture   llama",
        "parameters     912 (912)",
        "context length 256",
        "weights        F16 (2 tensors, 1.8 kB), F32 (1 tensor, 64 bytes); 2.04 bytes per weight",
        "tokenizer      BPE",
        "KV cache       -",
        "chat template  yes (--template prints it)",
        "license        apache-2.0",
    ]
    r = llmrun("show", "--template", ST_REPO)
    assert r.stdout == json.loads(st_files["tokenizer_config.json"])["chat_template"] + "\n"
    r = llmrun("show", "--template", f"{GGUF_REPO}:Q8_0")
    assert (r.returncode, r.stderr) == (1, f"error: {GGUF_REPO}:Q8_0 has no chat template\n")
    assert json.loads(llmrun("show", "--json", f"{GGUF_REPO}:Q8_0").stdout)["parameters"] == 64 * 32
    r = llmrun("rm", ST_REPO)
    assert (r.returncode, r.stderr) == (
        2,
        "error: rm asks before deleting: pass -y to delete without asking\n",
    )
    blobs = list((cache(ST_REPO) / "blobs").iterdir())
    r = llmrun("rm", "-y", f"{GGUF_REPO}:Q8_0", ST_REPO, ST_REPO)  # a name twice: once
    assert r.returncode == 0, r.stderr
    ref = 40  # refs/main goes too, as nothing else of either repo stays
    assert r.stdout.splitlines() == [
        f"deleted {GGUF_REPO}:Q8_0: {(q8 + ref) / 1000:.1f} kB freed",
        f"deleted {ST_REPO}: {(st + ref) / 1000:.1f} kB freed",
    ]
    assert not any(b.exists() for b in blobs)
    r = llmrun("rm", "-y", ST_REPO)
    assert (r.returncode, r.stderr) == (
        1,
        f"error: {ST_REPO} is not in the cache (see `llmrun list`)\n",
    )


def test_cli_exit_codes(fake):
    r = llmrun("pull", "test/nope")
    assert r.returncode == 1 and r.stderr.startswith("error: no model test/nope on http://")
    assert llmrun("pull").returncode == 2
    r = llmrun("pull", f"{GGUF_REPO}:Q4_K")
    assert r.returncode == 2 and "choose one of" in r.stderr


def test_cli_ctrl_c_keeps_the_partial_download(fake, gguf_files):
    fake.throttle = 300_000
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmrun", "pull", f"{GGUF_REPO}/stories260K.gguf"],
        env=dict(os.environ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    part = wait_for_part(GGUF_REPO, 50_000, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    kept = part.stat().st_size
    fake.throttle = None
    r = llmrun("pull", f"{GGUF_REPO}/stories260K.gguf")
    assert r.returncode == 0
    assert "resuming with" in r.stderr
    assert fake.served("cdn")[-1].headers["range"] == f"bytes={kept}-"


def test_rm_asks_on_a_terminal_and_ctrl_c_deletes_nothing(fake, gguf_files):
    import pexpect

    assert llmrun("pull", f"{GGUF_REPO}:Q8_0").returncode == 0
    command = [sys.executable, "-m", "llmrun", "rm", f"{GGUF_REPO}:Q8_0"]
    env = {**os.environ, "TERM": "dumb"}
    child = pexpect.spawn(command[0], command[1:], env=env, encoding="utf-8", timeout=60)
    child.expect_exact("delete 1 model(s)? [y/N]: ")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert child.before.endswith("\n")  # the shell's prompt starts on a line of its own
    assert len(json.loads(llmrun("list", "--json").stdout)) == 1
    child = pexpect.spawn(command[0], command[1:], env=env, encoding="utf-8", timeout=60)
    child.expect_exact("[y/N]: ")
    child.sendline("y")
    child.expect(pexpect.EOF)
    assert f"deleted {GGUF_REPO}:Q8_0" in child.before
    assert json.loads(llmrun("list", "--json").stdout) == []
