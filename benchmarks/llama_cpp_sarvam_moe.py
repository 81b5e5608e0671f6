"""llama.cpp's converter and llama-server against llmrun on the tiny Sarvam MoE model the
tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_sarvam_moe.py --llama-cpp DIR --converter SRC [--out FILE]

tests/models/test_sarvam_moe.py holds llmrun to transformers on a tiny random Sarvam MoE
(2 layers, hidden 64, a dense layer then 8 sigmoid-routed experts, 3 a token, one shared)
and on the "bailingmoe2" GGUFs llama.cpp's converter writes of its Hub-style folder (its
vocabulary step told the toy tokenizer is llama-bpe's, its config read as written:
run_converter, CONFIG_AS_WRITTEN). Here the converter (SRC/convert_hf_to_gguf.py) writes
the F32 and Q8_0 files, which both engines load: `DIR/llama-server -m FILE` (f32 KV cache,
no flash attention) answers /completion, and llmrun's engine runs the same prompt greedily
(for Q8_0 with exact products and with llama.cpp's 8-bit activations, --activations q8).
Prompts: random token ids, given as ids to both. Per file and prompt: each engine's greedy
tokens (8), how many agree from the start, the largest difference of the agreeing tokens'
log-probabilities. Results go to --out (benchmarks/out/llama_cpp_sarvam_moe.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from muse_glimmer_helpers import run_converter  # noqa: E402
from test_deepseek import routed_model  # noqa: E402
from test_sarvam_moe import CONFIG, CONFIG_AS_WRITTEN, save_hub_folder  # noqa: E402

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
    args = arguments(__doc__, OUT / "llama_cpp_sarvam_moe.json")
    from llmrun import api

    work = OUT / "sarvam_moe"
    folder = work / "hf"
    folder.mkdir(parents=True, exist_ok=True)
    save_hub_folder(routed_model(CONFIG), folder)
    files = {t: work / f"sarvam-{t}.gguf" for t in OUTTYPES}
    converter = args.converter / "convert_hf_to_gguf.py"
    outputs = {path: f"--outtype {t}" for t, path in files.items()}
    run_converter(folder, outputs, converter, CONFIG_AS_WRITTEN)
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
