"""Record llama.cpp's outputs on a family's tiny test model: the reference that
tests/models/test_FAMILY.py holds llmrun to (tests/llama_cpp_golden.py), for the
architectures only llama.cpp runs (not run by CI).

    python benchmarks/llama_cpp_golden.py FAMILY [--python /tmp/lcpp/bin/python]

Builds the folder through the test module's build_folder, converts it with the converter
the tests use (tests/data/cache/converter, `python tests/data/fetch.py`) into F32 and Q8_0
GGUFs (benchmarks/out/golden/FAMILY/), and runs each through llama.cpp's C API with
llama-cpp-python (--python: an interpreter that imports llama_cpp; not this one, whose
packages it does not need): logits of every prompt position in one batch (F32 KV cache,
no flash attention, one thread), then GREEDY greedy tokens decoded one at a time. Writes
tests/models/golden/FAMILY.json: per file type the prompt's ids, the full logits of a few
positions (rounded to 6 decimals) and the greedy ids, with llama.cpp's version and the
settings; for a module with TOKENIZER_TEXTS (a tokenizer of the family's own), llama.cpp's
ids of each text too ("tokenized").
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models")]

from llama_cpp_golden import FILE_TYPES, GOLDEN, GREEDY, PROMPT, convert  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "golden"
SETTINGS = dict(n_ctx=128, n_batch=128, n_threads=1, seed=0, type_k=0, type_v=0)
# Positions whose logits are kept: the first, two inside, the last (F32); fewer for Q8_0.
KEPT = {"f32": 4, "q8_0": 2}

# Run by --python: argv[1] the GGUF, argv[2] the prompt, argv[3] the greedy tokens, argv[4]
# the settings; prints the record entry as JSON. type_k = type_v = 0: GGML_TYPE_F32.
_LLAMA_CPP = """
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama

path, prompt, tokens, settings = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
assert llama_cpp.GGML_TYPE_F32 == settings["type_k"] == settings["type_v"] == 0
llm = Llama(path, logits_all=True, flash_attn=False, verbose=False, **settings)
ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
llm.eval(ids)
logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
greedy = []
for _ in range(tokens):
    greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval([greedy[-1]])
print(json.dumps(dict(
    version=llama_cpp.__version__, prompt_ids=ids, logits=logits.tolist(), greedy_ids=greedy
)))
"""

# Run by --python for a module's TOKENIZER_TEXTS: argv[1] the GGUF, argv[2] the texts (JSON);
# prints each text's ids without and with special tokens parsed, as JSON.
_TOKENIZE = """
import json, sys
from llama_cpp import Llama

llm = Llama(sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([
    dict(text=t, ids=llm.tokenize(t.encode(), add_bos=True, special=False),
         special_ids=llm.tokenize(t.encode(), add_bos=True, special=True))
    for t in json.loads(sys.argv[2])
]))
"""


def kept_positions(count: int, kept: int) -> list[int]:
    """`kept` positions spread over a prompt of `count` tokens, first and last among them."""
    return sorted({round(i * (count - 1) / (kept - 1)) for i in range(kept)})


def record(family: str, python: str) -> dict:
    """The record of FAMILY's test model (see the module's note)."""
    module = importlib.import_module(f"test_{family}")
    folder = OUT / family / family
    shutil.rmtree(folder.parent, ignore_errors=True)  # built afresh: never a stale record
    module.build_folder(folder)
    files = convert(folder, folder.parent, getattr(module, "CONVERTER_PATCH", ""))
    out = {"family": family, "prompt": PROMPT, "settings": dict(SETTINGS, flash_attn=False)}
    for kind in FILE_TYPES:
        command = [python, "-c", _LLAMA_CPP, str(files[kind]), PROMPT, str(GREEDY)]
        result = subprocess.run(
            [*command, json.dumps(SETTINGS)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise SystemExit(f"error: llama.cpp on {files[kind]}: {result.stderr[-2000:]}")
        run = json.loads(result.stdout)
        out["llama_cpp"] = f"llama-cpp-python {run['version']}"
        positions = kept_positions(len(run["prompt_ids"]), KEPT[kind])
        out[kind] = dict(
            prompt_ids=run["prompt_ids"],
            positions=positions,
            logits=[[round(v, 6) for v in run["logits"][p]] for p in positions],
            greedy_ids=run["greedy_ids"],
        )
    texts = getattr(module, "TOKENIZER_TEXTS", None)
    if texts:  # a tokenizer of the family's own: llama.cpp's ids of these texts
        command = [python, "-c", _TOKENIZE, str(files["f32"]), json.dumps(texts)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SystemExit(f"error: llama.cpp tokenizing: {result.stderr[-2000:]}")
        out["tokenized"] = json.loads(result.stdout)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", help="the test module's name after test_ (orion, xverse, ...)")
    parser.add_argument("--python", default="/tmp/lcpp/bin/python", help="imports llama_cpp")
    args = parser.parse_args()
    data = record(args.family, args.python)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    path = GOLDEN / f"{args.family}.json"
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{path}: {path.stat().st_size} bytes; greedy f32 {data['f32']['greedy_ids']}")


if __name__ == "__main__":
    main()
