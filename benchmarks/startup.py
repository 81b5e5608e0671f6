"""Where the start-up of `llmrun run MODEL "hi" -n 1` goes, phase by phase.

Each phase is timed in a fresh interpreter, as the run command reaches it: the bare
interpreter, the command line's imports (llmrun.cli: typer, rich, gguf), `import torch`,
the rest of llmrun's imports, the native library (built once and cached, so this is its
load), the GGUF header parse, the weight mapping (memory-mapped blocks, QuantLinear,
repacking into the kernels' layouts), the tokenizer from the GGUF metadata, the chat
template, and the first token (prefill of the prompt).
The whole command is timed too, end to end, so the phases can be checked against it.
Prints a markdown table of the median of --repeats runs and the spread.

    python benchmarks/startup.py MODEL.gguf [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PHASES = """
import json, sys, time
marks = [("start", time.perf_counter())]
def mark(name):
    marks.append((name, time.perf_counter()))
import llmrun.cli
mark("import llmrun.cli (typer, rich, gguf)")
import torch
mark("import torch")
from llmrun import api, native
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.tokenizer import Tokenizer
mark("import llmrun")
native.library()
mark("native library load")
path = sys.argv[1]
header = read_gguf(path)
mark("GGUF header parse")
loaded = load_model(api.Path(path), api.pick_device("cpu"), "auto")
mark("weight mapping and repacking (parses again)")
tokenizer = Tokenizer.from_gguf_metadata(loaded.checkpoint.gguf.metadata, path)
mark("tokenizer build")
engine = api.load(path, path=api.Path(path))
mark("api.load (everything above once more, warm)")
ids = engine.tokenizer.encode(engine.prompt_text("hi"))
response = next(iter(engine.generate(ids, engine.defaults, 1)))
mark("first token")
print(json.dumps([(b[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]))
"""


def run_phases(model: str) -> list[tuple[str, float]]:
    out = subprocess.run(
        [sys.executable, "-c", PHASES, model], capture_output=True, text=True, check=True
    )
    return [tuple(x) for x in json.loads(out.stdout.splitlines()[-1])]


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        rows.setdefault("bare interpreter (python -c pass)", []).append(
            wall([sys.executable, "-c", "pass"])
        )
        for name, seconds in run_phases(args.model):
            rows.setdefault(name, []).append(seconds)
        command = [sys.executable, "-m", "llmrun", "run", args.model, "hi", "-n", "1"]
        rows.setdefault("whole `llmrun run MODEL hi -n 1`", []).append(wall(command))
    print("| phase | median s | min s | max s |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in rows.items():
        print(
            f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |"
        )


if __name__ == "__main__":
    main()
