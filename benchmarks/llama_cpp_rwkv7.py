"""llama.cpp's converter and llama-server against llmrun on the tiny RWKV-7 and RWKV-6 the
tests use, and on a real rwkv7 or rwkv6 GGUF if given (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_rwkv7.py --llama-cpp DIR --converter SRC \\
        [--gguf REAL.gguf] [--out FILE]

tests/models/test_rwkv7.py holds llmrun to BlinkDL's `rwkv` package on a tiny random
RWKV-7 (hidden 64, 4 heads of 16, 2 blocks, the world vocabulary) written as an fla-hub
folder (tests/models/test_rwkv6.py: RWKV-6 as the Hugging Face port's Rwkv6ForCausalLM
folder); here the same with hidden 128 in 2 heads of 64 (LLAMA_CPP_CONFIG). The converter (SRC/convert_hf_to_gguf.py) writes its F32 and Q8_0 files,
which both engines load: `DIR/llama-server -m FILE` (no flash attention) answers
/completion, and llmrun's engine runs the same text prompts greedily (for Q8_0 also with
llama.cpp's 8-bit activations, --activations q8). Per file and prompt: the prompt's token
count in each engine (the world tokenizer), each engine's greedy tokens (8), how many
agree from the start, the largest difference of the agreeing tokens' log-probabilities,
and each engine's generation speed (tokens/s; honest only on a quiet machine). Results go
to --out (benchmarks/out/llama_cpp_rwkv7.json).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from muse_glimmer_helpers import run_converter  # noqa: E402
from rwkv_helpers import (  # noqa: E402
    _FRESH_MIXES,
    CONFIG,
    CONFIG6,
    folder6_of,
    folder_of,
)

OUT = ROOT / "benchmarks" / "out"
# The tests' model with heads of 64 (2 of them): llama.cpp's CPU wkv7 kernel (ggml-cpu
# ops.cpp, its SIMD path) steps through a head GGML_F32_STEP floats at a time (64 with
# AVX-512) with no remainder, so the tests' heads of 16 give it wrong logits.
LLAMA_CPP_CONFIG = CONFIG | dict(hidden_size=128, head_dim=64, intermediate_size=512)
LLAMA_CPP_CONFIG6 = CONFIG6 | dict(hidden_size=128, attention_hidden_size=128, head_size=64)
# family: (its folder writer, the model's config, the converter's patch)
FAMILIES = {
    "rwkv7": (folder_of, LLAMA_CPP_CONFIG, _FRESH_MIXES),
    "rwkv6": (folder6_of, LLAMA_CPP_CONFIG6, _FRESH_MIXES),
}
TOKENS = 8
PROMPTS = (
    "User: What is the capital of France?\n\nAssistant:",
    "def fibonacci(n):\n    ",
    "中文和日本語のテキスト 🤗🚀",
)
ACTIVATIONS = {"f32": ("f32",), "q8_0": ("f32", "q8"), "real": ("f32",)}
OUTTYPES = ("f32", "q8_0")


class _Base:
    """tmp_path_factory's one method rwkv_helpers calls: where to write."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def getbasetemp(self) -> Path:
        return self.path


def record_of(engine, server: LlamaServer, prompt: str) -> dict:
    ids = engine.tokenizer.encode(prompt)
    started = time.perf_counter()
    answer = greedy_completion(server, prompt, tokens=TOKENS)
    ours_started = time.perf_counter()
    ours, chosen = llmrun_greedy(engine, ids, TOKENS, top=1)
    ours_seconds = time.perf_counter() - ours_started
    record = agreement(ours, chosen, answer)
    return dict(
        prompt=prompt,
        **record,
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
        llama_cpp_tokens_per_second=answer.get("timings", {}).get("predicted_per_second"),
        llama_cpp_request_seconds=round(ours_started - started, 4),
        llmrun_request_seconds=round(ours_seconds, 4),
    )


def main() -> None:
    import argparse

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--gguf", type=Path, help="a real rwkv7 GGUF to compare too")
    real, rest = extra.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    args = arguments(__doc__, OUT / "llama_cpp_rwkv7.json")
    from llmrun import api

    work = OUT / "rwkv7"
    converter = args.converter / "convert_hf_to_gguf.py"
    files = {}
    for family, (folder_writer, config, patch) in FAMILIES.items():
        folder = folder_writer(_Base(work), config)
        made = {f"{family} {t}": folder.parent / f"{family}-{t}.gguf" for t in OUTTYPES}
        outputs = {path: f"--outtype {name.split()[1]}" for name, path in made.items()}
        run_converter(folder, outputs, converter, patch)
        files |= made
    if real.gguf is not None:
        files["real"] = real.gguf
    results = {}
    for kind, path in files.items():
        log = work / f"server-{kind}.log"
        with LlamaServer(args.llama_cpp, path, log, "-c", "2048") as server:
            for activations in ACTIVATIONS[kind.split()[-1]]:
                engine = api.load(str(path), device="cpu", activations=activations)
                name = f"{kind} {activations} activations"
                results[name] = [record_of(engine, server, p) for p in PROMPTS]
                for record in results[name]:
                    print(f"{name:>22}, {record['prompt'][:24]!r}: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
