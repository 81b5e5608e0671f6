"""llmrun: run LLMs from the command line in plain PyTorch."""

__version__ = "0.1.0"
