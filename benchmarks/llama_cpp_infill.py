"""llama.cpp's own /infill prompts against llmrun's (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_infill.py --llama-cpp DIR [--vocab NAME ...]
        [--out FILE]

For each of llama.cpp's code vocabularies (tests/data/cache/vocab, `python
tests/data/fetch.py`): qwen2 given Qwen2.5-Coder's FIM tokens at Qwen2.5's ids (the
repo-level pattern with <|repo_name|> and <|file_sep|>), starcoder (snippets),
deepseek-coder (BOS), refact (<reponame> without <|file_sep|>) and llama-spm given
CodeLlama's ▁<PRE>, ▁<SUF>, ▁<MID> (SentencePiece, BOS), it writes a tiny random
qwen2 model GGUF with that vocabulary into benchmarks/out/infill/, serves it with
`DIR/llama-server -c 8192 -n 16` (its default batch of 2048) and sends each case to its
/infill, greedy, with n_probs. llmrun builds the same prompt (llmrun.infill.fim_prompt with
llama-server's n_ctx, n_batch and n_predict) and the script checks, per case:

- tokens_evaluated (llama.cpp's prompt length) == len(llmrun's ids);
- the prompt text llama.cpp reports == llmrun's ids detokenized with special tokens;
- llama.cpp's /completion given llmrun's ids as a token array answers exactly what its
  /infill answered (the same tokens and the same n_probs to the last digit: the same
  prompt through the same engine), so the ids, not only their count and text, agree;
- llmrun's greedy tokens for its ids against llama.cpp's, and the largest difference of
  their top logprobs at the steps where they agree, llama.cpp's steps matched to llmrun's
  by token id (it reports none for a token ending inside a UTF-8 character; both exact
  f32: about 5e-3 apart is llama.cpp's f16 KV cache).

The "long" case cuts all three parts (prefix past 3/4 of the batch, suffix past 1/4,
the other files past n_ctx - n_batch - 2 * n_predict). Results go to --out
(benchmarks/out/llama_cpp_infill.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from gguf import GGUFReader, Keys, TokenType

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from helpers import FIM_TOKENS, VOCAB_DIR, tiny_hf_model, write_gguf  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreeing,
    llmrun_greedy,
    max_top_logprob_diff,
)
from tokenizer_fuzz import _field_value  # noqa: E402

from llmrun import api  # noqa: E402
from llmrun.infill import fim_prompt  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
N_CTX, N_BATCH, N_PREDICT = 8192, 2048, 16  # llama-server -c, -b (its default), -n
GENERATE, N_PROBS = 8, 5
VOCABS = ("qwen2.5-coder", "starcoder", "deepseek-coder", "refact", "codellama")
# CodeLlama's FIM tokens, given ids 32000 to 32003 after Llama 2's SentencePiece vocabulary
# (CodeLlama has them at 32007 to 32010, among 16 tokens it adds).
CODELLAMA_TOKENS = ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>")
CODE = "def fib(n):\n    if n < 2:\n        return n\n"
CASES = {
    "plain": dict(prefix="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))\n"),
    "extra+prompt": dict(
        prefix="import utils\n\nx = utils.",
        suffix="\nprint(x)  # <fim_middle> and <|fim_pad|> stay text here\n",
        extra=[
            {"filename": "utils.py", "text": "def helper():\n    return 'é ✓ 日本'\n"},
            {"text": "Y = 2\n"},
        ],
        prompt="hel",
    ),
    "empty": dict(prefix="", suffix=""),
    "long": dict(
        prefix=CODE * 150,
        suffix=CODE * 60,
        extra=[{"filename": f"f{i}.py", "text": CODE * 40} for i in range(12)],
        prompt="    ",
    ),
}


def write_model(vocab: str, out: Path) -> None:
    """A tiny random qwen2 (width 64, 2 layers) with the vocabulary's tokenizer metadata."""
    source = {"qwen2.5-coder": "qwen2", "codellama": "llama-spm"}.get(vocab, vocab)
    reader = GGUFReader(VOCAB_DIR / f"ggml-vocab-{source}.gguf")
    fields = {f.name: f for f in reader.fields.values()}
    values = {
        name: _field_value(field) for name, field in fields.items() if name.startswith("tokenizer.")
    }
    if vocab == "qwen2.5-coder":  # Qwen2.5's FIM tokens where this file has placeholders
        tokens, kind, sub = values[Keys.Tokenizer.LIST]
        types, tkind, tsub = values[Keys.Tokenizer.TOKEN_TYPE]
        tokens, types = list(tokens), list(types)
        for i, text in enumerate(FIM_TOKENS[:6], start=151659):
            tokens[i], types[i] = text.encode(), int(TokenType.CONTROL)
        values[Keys.Tokenizer.LIST] = (tokens, kind, sub)
        values[Keys.Tokenizer.TOKEN_TYPE] = (types, tkind, tsub)
    if vocab == "codellama":
        for key, added in [
            (Keys.Tokenizer.LIST, [t.encode() for t in CODELLAMA_TOKENS]),
            (Keys.Tokenizer.SCORES, [0.0] * 4),
            (Keys.Tokenizer.TOKEN_TYPE, [int(TokenType.CONTROL)] * 4),
        ]:
            value, kind, sub = values[key]
            values[key] = (list(value) + added, kind, sub)
    n_vocab = len(values[Keys.Tokenizer.LIST][0])
    model, config = tiny_hf_model("qwen2", vocab_size=n_vocab, max_position_embeddings=N_CTX)

    def tokenizer(writer) -> None:
        for name, (value, kind, sub) in values.items():
            writer.add_key_value(name, value, kind, sub)

    write_gguf(out, config, model.state_dict(), tokenizer=False, extra=tokenizer)


def request(case: dict) -> dict:
    return {
        "input_prefix": case["prefix"],
        "input_suffix": case["suffix"],
        "input_extra": case.get("extra", []),
        "prompt": case.get("prompt", ""),
    }


def compare(llama_cpp: Path, vocab: str, work: Path) -> dict:
    model_file = work / f"{vocab}.gguf"
    if not model_file.exists():
        write_model(vocab, model_file)
    engine = api.load(str(model_file), device="cpu", ctx_size=N_CTX)
    tok = engine.tokenizer
    extra = ("-c", str(N_CTX), "-n", str(N_PREDICT), "-b", str(N_BATCH))
    server = LlamaServer(llama_cpp, model_file, work / f"{vocab}.log", *extra)
    sampling = {
        "temperature": 0,
        "n_predict": GENERATE,
        "n_probs": N_PROBS,
        "return_tokens": True,
        "cache_prompt": False,
    }
    results = {}
    try:
        for name, case in CASES.items():
            body = request(case)
            files = [(f.get("filename", "tmp"), f["text"]) for f in body["input_extra"]]
            ids = fim_prompt(
                tok,
                body["input_prefix"],
                body["input_suffix"],
                files,
                body["prompt"],
                n_ctx=N_CTX,
                n_batch=N_BATCH,
                n_predict=N_PREDICT,
            )
            infill = server._post("/infill", {**body, **sampling})
            replay = server._post("/completion", {"prompt": ids, **sampling})
            ours, chosen = llmrun_greedy(engine, ids, GENERATE, top=N_PROBS)
            results[name] = {
                "prompt_tokens": len(ids),
                "llama_cpp_prompt_tokens": infill["tokens_evaluated"],
                "same_count": infill["tokens_evaluated"] == len(ids),
                "same_text": infill["prompt"] == tok.decode(ids, skip_special=False),
                "replay_identical": (
                    replay["tokens"] == infill["tokens"]
                    and replay["completion_probabilities"] == infill["completion_probabilities"]
                ),
                "greedy_tokens_equal": f"{agreeing(ours, infill['tokens'])}/{len(infill['tokens'])}",
                "max_top_logprob_diff": max_top_logprob_diff(chosen, infill),
            }
            print(vocab, name, json.dumps(results[name]), flush=True)
    finally:
        server.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama-server")
    parser.add_argument("--vocab", action="append", choices=VOCABS, help="(default: all)")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_infill.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = OUT / "infill"
    work.mkdir(parents=True, exist_ok=True)
    results = {v: compare(args.llama_cpp, v, work) for v in args.vocab or VOCABS}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    ok = all(
        r["same_count"] and r["same_text"] and r["replay_identical"]
        for cases in results.values()
        for r in cases.values()
    )
    print("prompts identical to llama.cpp's" if ok else "PROMPTS DIFFER", f"-> {args.out}")


if __name__ == "__main__":
    main()
