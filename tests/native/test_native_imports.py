"""Imports point one way: models -> ops -> native, quant -> native. A model file
reaches neither the quantization package nor gguf, directly or through ops.py."""

import json
import subprocess
import sys

# In a fresh interpreter: the conftest and other tests here have imported quant already.
IMPORT_MODELS = """
import importlib, json, pkgutil, sys
import llmrun.models
for m in pkgutil.iter_modules(llmrun.models.__path__):
    importlib.import_module(f"llmrun.models.{m.name}")
print(json.dumps(sorted(sys.modules)))
"""


def test_model_files_import_neither_quant_nor_gguf():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_MODELS], capture_output=True, text=True, check=True
    )
    modules = json.loads(result.stdout)
    assert "llmrun.models.llama" in modules and "llmrun.native" in modules
    assert [m for m in modules if m.split(".")[0] == "gguf" or m.startswith("llmrun.quant")] == []
