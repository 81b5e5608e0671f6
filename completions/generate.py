"""Write llmrun's shell completion scripts (bash, zsh, fish) from the Typer app.

Run `python completions/generate.py` after changing the CLI; tests/test_completions.py
fails when the committed scripts differ from what this produces.
"""

from pathlib import Path

from typer._completion_shared import get_completion_script

from llmrun.cli import app

SHELLS = ("bash", "zsh", "fish")
HERE = Path(__file__).parent


def script(shell: str) -> str:
    name = app.info.name
    return (
        get_completion_script(prog_name=name, complete_var=f"_{name.upper()}_COMPLETE", shell=shell)
        + "\n"
    )


if __name__ == "__main__":
    for shell in SHELLS:
        (HERE / f"llmrun.{shell}").write_text(script(shell))
