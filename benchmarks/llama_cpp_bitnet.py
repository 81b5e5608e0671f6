"""llama-server and llama-bench on BitNet GGUFs written by llama.cpp's converter, against
llmrun on the same files (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_bitnet.py --llama-cpp DIR [--out FILE]

DIR holds llama.cpp's prebuilt llama-server and llama-bench (e.g. /tmp/llama-cpp-avx512/bin).
A tiny random BitNet in 1bitLLM's layout (tests/models/test_bitnet.py's write_one_bit_llm:
hidden 256, one layer, stories260K's vocabulary) goes through llama.cpp's converter
(tests/data/cache/converter, `python tests/data/fetch.py`) with --outtype tq2_0 and tq1_0;
for each file and prompt, llama-server's greedy tokens (f32 KV cache, no flash attention)
against llmrun's on the file, with the largest difference of their top-5 log-probabilities
where they agree, llmrun's products exact (`f32`) and with llama.cpp's Q8_K activations
(`q8`). Then a bigger one (hidden 1024, 8 layers, width 2816) in TQ2_0 for speed:
`llama-bench -p 64 -n 32` against `llmrun bench -p 64 -n 32` (f32 and q8 activations),
the same thread count. Files go to benchmarks/out/bitnet/; the figures to --out
(benchmarks/out/llama_cpp_bitnet.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreeing,
    convert,
    greedy_completion,
    llmrun_greedy,
    max_top_logprob_diff,
)
from test_bitnet import write_one_bit_llm  # noqa: E402

from llmrun import api  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
CONVERTER = ROOT / "tests" / "data" / "cache" / "converter"
GENERATE, N_PROBS = 16, 5
PROMPTS = ("Once upon a time", "The little dog ran to the park and saw a big red ball.")
SPEED = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16)


def gguf_of(work: Path, name: str, outtype: str, **config) -> Path:
    folder, path = work / name, work / f"{name}-{outtype}.gguf"
    if not (folder / "config.json").is_file():
        write_one_bit_llm(folder, **config)
    if not path.is_file():
        convert(CONVERTER, folder, path, "--outtype", outtype)
    return path


def parity(llama_cpp: Path, path: Path) -> dict:
    results = {}
    with LlamaServer(llama_cpp, path, path.with_suffix(".log")) as server:
        for activations in ("f32", "q8"):
            engine = api.load(str(path), device="cpu", activations=activations)
            for prompt in PROMPTS:
                ids = engine.tokenizer.encode(prompt)
                theirs = greedy_completion(server, ids, (), GENERATE, N_PROBS)
                ours, chosen = llmrun_greedy(engine, ids, GENERATE, top=N_PROBS)
                record = {
                    "greedy_tokens_equal": f"{agreeing(ours, theirs['tokens'])}/{GENERATE}",
                    "max_top_logprob_diff": max_top_logprob_diff(chosen, theirs),
                }
                results[f"{activations} {prompt}"] = record
                print(path.name, activations, json.dumps(prompt), json.dumps(record), flush=True)
    return results


def speed(llama_cpp: Path, path: Path, threads: int) -> dict:
    common = ["-p", "64", "-n", "32", "-r", "3", "-t", str(threads)]
    theirs = subprocess.run(
        [str(llama_cpp / "llama-bench"), "-m", str(path), *common, "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = {}
    for record in json.loads(theirs.stdout):
        test = f"pp{record['n_prompt']}" if record["n_prompt"] else f"tg{record['n_gen']}"
        result[f"llama_cpp {test}"] = record["avg_ts"]
    for activations in ("f32", "q8"):
        ours = subprocess.run(
            [sys.executable, "-m", "llmrun", "bench", str(path), *common,
             "--activations", activations, "-o", "json"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        for record in json.loads(ours.stdout):
            result[f"llmrun {activations} {record['test']}"] = record["avg_ts"]
    print(path.name, json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama-server")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_bitnet.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = OUT / "bitnet"
    work.mkdir(parents=True, exist_ok=True)
    results = {
        f"parity {outtype}": parity(args.llama_cpp, gguf_of(work, "tiny", outtype))
        for outtype in ("tq2_0", "tq1_0")
    }
    big = gguf_of(work, "speed", "tq2_0", **SPEED)
    results["speed tq2_0"] = speed(args.llama_cpp, big, args.threads)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
