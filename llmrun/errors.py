"""Typed errors raised by the library; cli.py prints them as one `error:` line.

Each error says what failed, where (file, key, tensor) and what to try. This
module imports nothing, so every layer can raise these.
"""


class LlmrunError(Exception):
    """Base of every error a user should see as one line, not a traceback."""

    exit_code = 1


class UsageError(LlmrunError):
    """Bad flag values or argument combinations (exit code 2, like a parse error)."""

    exit_code = 2


class ModelNotFoundError(LlmrunError):
    """The model path or name does not point at a model."""


class ModelFormatError(LlmrunError):
    """A model file is missing parts, truncated or corrupt."""


class UnsupportedError(LlmrunError):
    """Something llmrun refuses to guess: an architecture, weight type, RoPE or pre-tokenizer."""


class TokenizerError(LlmrunError):
    """The tokenizer is missing or cannot be built."""


class TemplateError(LlmrunError):
    """A chat template failed to render or tried to escape its sandbox."""


class ContextOverflowError(LlmrunError):
    """A prompt or conversation does not fit in the context window."""


class HubError(LlmrunError):
    """Downloading from or resolving a name on the Hugging Face Hub failed."""


class ServerBusyError(LlmrunError):
    """Every serving slot is taken and the wait queue is full."""
