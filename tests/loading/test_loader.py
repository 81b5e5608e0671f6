"""Loading as a user's process sees it: what loading a model costs besides the weights."""

import subprocess
import sys

LOAD_AND_GENERATE = """
import sys
from llmrun import api
from llmrun.sampling import SamplingParams
engine = api.load(None, device="cpu")
prompt = engine.tokenizer.encode("Once upon a time")
text = "".join(r.text for r in engine.generate(prompt, SamplingParams(temperature=0), 8))
assert text.strip(), text
print(sorted(m for m in ("torch._dynamo", "sympy", "torch._inductor") if m in sys.modules))
"""


def test_loading_and_generating_import_no_compiler_stack():
    # Building the model on the meta device used to run nn.init's normal_ through
    # torch._refs, which imports torch._dynamo and sympy: ~1.8 s and ~70 MB for every
    # `llmrun run`. A fresh interpreter, since other tests may import them.
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_GENERATE], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
