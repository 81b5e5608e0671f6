"""llama-server on the GGUF llama.cpp's converter writes of a Mistral native folder, against
llmrun on the folder itself (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_mistral_native.py --llama-cpp DIR [--out FILE]

For a tiny random Mistral and a tiny random Ministral 3 (YaRN over an original context of
16, Llama 4's query temperature past it), written as native folders (params.json,
consolidated.safetensors, tekken.json) by tests/loading/test_mistral_native.py's mapping
into benchmarks/out/mistral_native/, the script converts each with
`convert_hf_to_gguf.py --mistral-format` (F32; tests/data/cache/converter, `python
tests/data/fetch.py`), serves the GGUF with `DIR/llama-server` (f32 KV cache, no flash
attention) and, for each prompt, checks:

- llama-server's /tokenize of the prompt (BOS added) == llmrun's ids for it from tekken.json
  (plain ASCII and Latin text, where llama.cpp's approximation of the pattern agrees);
- the greedy tokens of llama-server's /completion (given llmrun's ids) against llmrun's on
  the native folder (16 tokens), and the largest difference of their top-5 logprobs at the
  steps where they agree, matched by token id (both f32 here, with an f32 KV cache).

Results go to --out (benchmarks/out/llama_cpp_mistral_native.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "loading"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreeing,
    greedy_completion,
    llmrun_greedy,
    max_top_logprob_diff,
)
from test_mistral_native import MINISTRAL3_ROPE, YARN, convert, hf_model, write_native  # noqa: E402

from llmrun import api  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
GENERATE, N_PROBS = 16, 5
PROMPTS = (
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog, and then some more words follow here.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
)


def write_models(work: Path) -> dict[str, Path]:
    folders = {"mistral": work / "mistral", "ministral3": work / "ministral3"}
    if not (folders["mistral"] / "params.json").is_file():
        write_native(hf_model(), folders["mistral"])
    if not (folders["ministral3"] / "params.json").is_file():
        scaling = dict(original_max_position_embeddings=16, beta=0.1)
        write_native(
            hf_model("ministral3", rope_parameters=MINISTRAL3_ROPE),
            folders["ministral3"],
            yarn={**YARN, "apply_scale": False},
            llama_4_scaling=scaling,
        )
    return folders


def compare(llama_cpp: Path, name: str, folder: Path, work: Path) -> dict:
    gguf = work / f"{name}.gguf"
    if not gguf.is_file():
        convert(folder, gguf)
    engine = api.load(str(folder), device="cpu")
    results = {}
    with LlamaServer(llama_cpp, gguf, work / f"{name}.log") as server:
        for prompt in PROMPTS:
            ids = engine.tokenizer.encode(prompt)
            theirs = greedy_completion(server, ids, (), GENERATE, N_PROBS)
            ours, chosen = llmrun_greedy(engine, ids, GENERATE, top=N_PROBS)
            results[prompt] = {
                "prompt_tokens": len(ids),
                "same_prompt_ids": server.tokenize(prompt, True, False) == ids,
                "greedy_tokens_equal": f"{agreeing(ours, theirs['tokens'])}/{len(theirs['tokens'])}",
                "max_top_logprob_diff": max_top_logprob_diff(chosen, theirs),
            }
            print(name, json.dumps(prompt), json.dumps(results[prompt]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama-server")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_mistral_native.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = OUT / "mistral_native"
    work.mkdir(parents=True, exist_ok=True)
    results = {
        name: compare(args.llama_cpp, name, folder, work)
        for name, folder in write_models(work).items()
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
