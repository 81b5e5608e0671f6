"""Where llmrun keeps its files: model cache, state (REPL history), config.

Everything lives under platformdirs' user directories unless LLMRUN_HOME is set,
in which case everything lives under that one folder.
"""

import os
from pathlib import Path

import platformdirs

APP_NAME = "llmrun"
BUNDLED_MODEL = Path(__file__).parent / "data" / "stories260K.gguf"


def _home() -> Path | None:
    home = os.environ.get("LLMRUN_HOME")
    return Path(home).expanduser() if home else None


def cache_dir() -> Path:
    """Folder holding downloaded models."""
    home = _home()
    return home / "models" if home else Path(platformdirs.user_cache_dir(APP_NAME)) / "models"


def state_dir() -> Path:
    """Folder holding state worth keeping across runs (REPL history)."""
    home = _home()
    return home / "state" if home else Path(platformdirs.user_state_dir(APP_NAME))
