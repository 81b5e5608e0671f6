"""`python -m llmrun`."""

from llmrun.cli import main

main()
