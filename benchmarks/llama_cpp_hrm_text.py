"""llama.cpp's converter and llama-server against llmrun on the tiny HRM-Text model the
tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_hrm_text.py --llama-cpp DIR --converter SRC [--out FILE]

tests/models/test_hrm_text.py holds llmrun to transformers on a tiny random
HrmTextForCausalLM (2 layers a stack, 2 H cycles of 2 L cycles, hidden 64, its matrices
at half randomize()'s scale) and on the "hrm_text" GGUF llama.cpp's converter writes of
its folder (its vocabulary step given the toy SentencePiece tokenizer). Here the
converter (SRC/convert_hf_to_gguf.py) writes the F32 and Q8_0 files, which both engines
load: `DIR/llama-server -m FILE` (f32 KV cache, no flash attention) answers /completion,
and llmrun's engine runs the same prompt greedily (for Q8_0 with exact products and with
llama.cpp's 8-bit activations, --activations q8). Prompts: random token ids, given as ids
to both. Per file and prompt: each engine's greedy tokens (8), how many agree from the
start, the largest difference of the agreeing tokens' log-probabilities. Results go to
--out (benchmarks/out/llama_cpp_hrm_text.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from helpers import save_hf_dir  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from muse_glimmer_helpers import run_converter  # noqa: E402
from test_hrm_text import CONFIG, LLAMA_VOCAB, hrm_model  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
TOKENS = 8
SEEDS = (1, 2, 3)
OUTTYPES = ("f32", "q8_0")
# llmrun's products of each file's weights: exact, and for Q8_0 also with llama.cpp's
# 8-bit-quantized activations (--activations q8), which its dot products use.
ACTIVATIONS = {"f32": ("f32",), "q8_0": ("f32", "q8")}


def record_of(engine, server: LlamaServer, seed: int) -> dict:
    import torch

    vocab = CONFIG["vocab_size"]
    ids = torch.randint(3, vocab, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
    answer = greedy_completion(server, ids, tokens=TOKENS)
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, top=1), answer)
    return dict(
        prompt=f"20 random ids, seed {seed}",
        **record,
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_hrm_text.json")
    from llmrun import api

    work = OUT / "hrm_text"
    work.mkdir(parents=True, exist_ok=True)
    folder = save_hf_dir(hrm_model(CONFIG), work / "hf", tokenizer=True)
    files = {t: work / f"hrm_text-{t}.gguf" for t in OUTTYPES}
    converter = args.converter / "convert_hf_to_gguf.py"
    outputs = {path: f"--outtype {t}" for t, path in files.items()}
    run_converter(folder, outputs, converter, LLAMA_VOCAB)
    results = {}
    for outtype, path in files.items():
        with LlamaServer(args.llama_cpp, path, work / f"server-{outtype}.log") as server:
            for activations in ACTIVATIONS[outtype]:
                engine = api.load(str(path), device="cpu", activations=activations)
                name = f"{outtype} {activations} activations"
                results[name] = [record_of(engine, server, seed) for seed in SEEDS]
                for record in results[name]:
                    print(f"{name:>22}, {record['prompt']}: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
