"""Imported by the command line before anything that imports gguf: gguf without
mistral_common's tokenizers.

gguf imports them with itself where they are installed (vLLM's environments, this
project's tests), ~0.8 s of a command's start-up, for gguf.vocab's MistralVocab, which
llmrun never uses. Here the import is made to fail (None in sys.modules), and gguf goes
on without them. Only the command line does this: model code imports no gguf at all,
and a program that imports llmrun keeps gguf as it is.
"""

import sys


def import_gguf() -> None:
    """Import gguf, without mistral_common unless it is already imported."""
    if "gguf" in sys.modules or "mistral_common" in sys.modules:
        return
    sys.modules["mistral_common"] = None
    try:
        import gguf  # noqa: F401
    finally:
        del sys.modules["mistral_common"]


import_gguf()
