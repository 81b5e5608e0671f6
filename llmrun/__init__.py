"""llmrun: run LLMs from the command line in plain PyTorch."""

import sys

__version__ = "0.1.0"


def _import_gguf() -> None:
    """gguf imports mistral_common's tokenizers with itself where they are installed
    (0.6-0.9 s: a sixth of `llmrun run`'s start-up) for gguf.vocab's MistralVocab, which
    llmrun never uses; the import is made to fail there (None in sys.modules), so gguf
    goes on without them. Where mistral_common is already imported, it costs nothing."""
    if "gguf" in sys.modules or "mistral_common" in sys.modules:
        return
    sys.modules["mistral_common"] = None
    try:
        import gguf  # noqa: F401
    finally:
        del sys.modules["mistral_common"]


_import_gguf()
