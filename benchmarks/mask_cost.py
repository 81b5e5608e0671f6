"""The cost per token of a grammar's mask (structured outputs), next to a decode step.

For each grammar (a tool-call JSON schema, any JSON object, a Hermes tool call as the
server's tool_choice "required" writes it), compiles it once for a 152k vocabulary, then
decodes under it as llmrun does: per token, llguidance computes the mask, the Sampler's
Constraint sends every forbidden logit to -inf, a token is drawn (at random among the
allowed ones, so the walk covers strings, numbers and structure; the draw is not timed)
and the grammar takes it. It reports the mean, P50 and P99 of that per-token cost in
microseconds, counting the mask's whole computation (in decoding it overlaps the
forward pass, on a worker thread).

With MODEL (a GGUF or HF directory of Qwen2.5-0.5B's shape, such as the one
`python benchmarks/make_qwen_model.py --types Q8_0` writes), the vocabulary is the
model's own and the script also times its decode steps (one token at a position of
`--depth`, `-t` threads), then prints the mask's cost as a share of a decode step; the
target is below 10%. Without MODEL the vocabulary is llama.cpp's ggml-vocab-qwen2.gguf
(fetched by `python tests/data/fetch.py`), and only the mask is timed.

    python benchmarks/mask_cost.py [MODEL] [-n 256] [-t 2] [--depth 256] [--json]

Run it on a quiet machine: both sides are CPU-bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
VOCABS = [
    HERE.parent / "tests/data/cache/vocab/ggml-vocab-qwen2.gguf",
    HERE.parents[1] / "shared/vocab/ggml-vocab-qwen2.gguf",
]
ARGUMENTS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["city", "days", "unit", "hourly", "fields"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "get_forecast", "parameters": ARGUMENTS}}


def grammars(vocab):
    from llmrun.tool_calls import get_format

    hermes = get_format("hermes").grammar([TOOL], vocab.token, parallel=False)
    return {
        "json_schema (tool arguments)": lambda: vocab.json_schema(ARGUMENTS),
        "json_object": lambda: vocab.json_schema(None),
        "hermes tool call (required)": lambda: vocab.lark(hermes),
    }


def time_mask(grammar, size: int, tokens: int, seed: int) -> list[float]:
    """Per-token seconds of the mask (computed, applied to the logits) and of the grammar
    taking the token, over `tokens` tokens (the grammar restarts when it completes). The
    draw is left out: greedy or sampled, a decode step draws anyway. In decoding, the
    mask's computation overlaps the forward pass; here nothing comes between, so the
    whole of it counts."""
    import torch

    rng = np.random.default_rng(seed)
    costs: list[float] = []
    constraint = grammar.constraint()
    while len(costs) < tokens:
        logits = torch.from_numpy(rng.standard_normal(size).astype(np.float32))
        start = time.perf_counter()
        masked = constraint.apply(logits)
        spent = time.perf_counter() - start
        token = int(rng.choice(np.flatnonzero(np.isfinite(masked.numpy()))))
        start = time.perf_counter()
        constraint.accept(token)
        if not constraint.done:
            constraint.compute()
        costs.append(spent + time.perf_counter() - start)
        if constraint.done:
            constraint = grammar.constraint()
    return costs


def time_decode(engine, steps: int, depth: int, size: int) -> list[float]:
    """Seconds per decode step (one token, batch 1) at `depth` tokens of context."""
    import torch

    from llmrun.generate import prefill

    state = engine.new_state(depth + steps + 8)
    device = state.cache.k.device
    tokens = [(7 + 31 * i) % size for i in range(depth + steps + 2)]
    with torch.inference_mode():
        prefill(engine.model, state, tokens[:depth])
        times = []
        for token in tokens[depth:]:
            position = len(state.tokens)
            ids = torch.tensor([[token]], device=device)
            start = time.perf_counter()
            engine.model(ids, torch.tensor([[position]], device=device), state.cache)
            times.append(time.perf_counter() - start)
            state.tokens.append(token)
    return times[2:]  # the first steps warm up


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "mean_us": statistics.fmean(values) * 1e6,
        "p50_us": statistics.median(values) * 1e6,
        "p99_us": p99 * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a model of Qwen2.5-0.5B's shape")
    parser.add_argument("-n", "--tokens", type=int, default=256, help="tokens per grammar")
    parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (decode)")
    parser.add_argument("--depth", type=int, default=256, help="context before the timed steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps to time")
    parser.add_argument("--json", action="store_true", help="print one JSON record")
    args = parser.parse_args()

    from llmrun import structured

    engine = None
    if args.model:
        from llmrun import api

        engine = api.load(args.model, device="cpu", threads=args.threads)
        tokenizer, eos, size = (
            engine.tokenizer,
            engine.eos_ids,
            engine.checkpoint.config.get("vocab_size", engine.tokenizer.vocab_size),
        )
    else:
        from llmrun.tokenizer import load_tokenizer

        vocab_file = next((v for v in VOCABS if v.is_file()), None)
        if vocab_file is None:
            sys.exit("no ggml-vocab-qwen2.gguf: run python tests/data/fetch.py, or give MODEL")
        tokenizer = load_tokenizer(vocab_file)
        eos, size = [tokenizer.eos_id], tokenizer.vocab_size
    start = time.perf_counter()
    vocab = structured.vocabulary(tokenizer, eos)
    record: dict = {
        "vocabulary": size,
        "vocabulary_build_s": round(time.perf_counter() - start, 3),
        "tokens_per_grammar": args.tokens,
        "grammars": {},
    }
    for name, build in grammars(vocab).items():
        start = time.perf_counter()
        grammar = build()
        compile_s = time.perf_counter() - start
        costs = time_mask(grammar, size, args.tokens, seed=0)
        record["grammars"][name] = {"compile_ms": round(compile_s * 1e3, 2), **stats(costs)}
    worst = max(g["mean_us"] for g in record["grammars"].values())
    if engine is not None:
        decode = stats(time_decode(engine, args.steps, args.depth, size))
        record["decode_step"] = {**decode, "threads": args.threads, "depth": args.depth}
        record["worst_mask_share_of_decode"] = worst / decode["mean_us"]
    if args.json:
        print(json.dumps(record))
        return
    print(
        f"vocabulary {size} tokens, built for the grammar engine in {record['vocabulary_build_s']} s"
    )
    print(f"{'grammar':32} {'compile ms':>10} {'mean us':>9} {'p50 us':>9} {'p99 us':>9}")
    for name, g in record["grammars"].items():
        print(
            f"{name:32} {g['compile_ms']:10.1f} {g['mean_us']:9.1f} {g['p50_us']:9.1f} "
            f"{g['p99_us']:9.1f}"
        )
    if engine is not None:
        d = record["decode_step"]
        share = record["worst_mask_share_of_decode"]
        print(
            f"decode step of {args.model}: mean {d['mean_us'] / 1e3:.2f} ms, p50 {d['p50_us'] / 1e3:.2f} ms"
        )
        verdict = "below" if share < 0.10 else "ABOVE"
        print(f"the costliest mask is {share:.1%} of a decode step ({verdict} the 10% target)")


if __name__ == "__main__":
    main()
