"""The committed shell completion scripts match what the Typer app generates."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMPLETIONS = Path(__file__).resolve().parents[1] / "completions"


def generator():
    spec = importlib.util.spec_from_file_location("generate", COMPLETIONS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts_are_current(shell):
    committed = (COMPLETIONS / f"llmrun.{shell}").read_text()
    assert committed == generator().script(shell), "run: python completions/generate.py"


def test_bash_completion_completes_commands_and_flags():
    def complete(words: str, cword: int) -> list[str]:
        env = {
            **os.environ,
            "COMP_WORDS": words,
            "COMP_CWORD": str(cword),
            "_LLMRUN_COMPLETE": "complete_bash",
        }
        out = subprocess.run(
            [sys.executable, "-m", "llmrun"], env=env, capture_output=True, text=True
        )
        return out.stdout.split()

    assert "run" in complete("llmrun r", 1)
    assert "--temperature" in complete("llmrun run --te", 2)
