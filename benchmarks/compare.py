"""Side by side: llmrun bench, llama-cpp-python and transformers on one GGUF file.

Every engine runs in a subprocess of its own (with its own interpreter where given)
with the same prompt and generation lengths, threads and repetitions, measured as
llama-bench does: random token ids, a discarded warm-up, then the timed runs; ppP
processes P tokens in one go, tgN decodes N tokens one at a time from an empty
cache. Prints one markdown table with each engine's tokens/s (mean ± sd) and
llmrun's speed relative to it. An engine that is not installed is skipped with a note.

transformers reads the GGUF with `gguf_file=` (needs the gguf package), which
dequantizes every weight to --transformers-dtype; --hf-dir gives it a Hugging Face
directory instead. It runs with a DynamicCache and keeps only the last logits.

Usage:
  python benchmarks/compare.py MODEL.gguf [-p 512] [-n 128] [-t 2] [-r 3]
      [--llama-cpp-python /tmp/lcpp/bin/python] [--transformers-python PYTHON]
      [--transformers-dtype bf16|f32] [--hf-dir DIR] [--engines llmrun,llama.cpp]

Only the standard library is imported at the top: the workers import their engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("llmrun", "llama.cpp", "transformers")
MODULES = {"llama.cpp": "llama_cpp", "transformers": "transformers"}


def timed_runs(repetitions: int, run) -> list[float]:
    """Seconds of each run after a discarded warm-up; run(rep) gets fresh random ids."""
    seconds = []
    for rep in range(repetitions + 1):
        elapsed = run(rep)
        if rep:
            seconds.append(elapsed)
    return seconds


def worker_llama_cpp(args: argparse.Namespace) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=max(args.n_prompt, args.n_gen) + 1,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_gpu_layers=0,
        verbose=False,
    )
    rng = random.Random(0)
    vocab = llm.n_vocab()

    def run(tokens: int, one_at_a_time: bool) -> float:
        ids = [rng.randrange(vocab) for _ in range(tokens)]
        llm.reset()
        start = time.perf_counter()
        for batch in [[i] for i in ids] if one_at_a_time else [ids]:
            llm.eval(batch)
        llama_cpp.llama_synchronize(llm.ctx)
        return time.perf_counter() - start

    return {
        "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "pp": timed_runs(args.repetitions, lambda rep: run(args.n_prompt, False)),
        "tg": timed_runs(args.repetitions, lambda rep: run(args.n_gen, True)),
    }


def worker_transformers(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.transformers_dtype]
    if args.hf_dir:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=dtype)
        source = "safetensors"
    else:
        path = Path(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
        source = "dequantized GGUF"
    model.eval()
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def pp(rep: int) -> float:
        ids = torch.randint(vocab, (1, args.n_prompt), generator=generator)
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    def tg(rep: int) -> float:
        ids = torch.randint(vocab, (1, args.n_gen), generator=generator)
        cache = transformers.DynamicCache(config=model.config)
        start = time.perf_counter()
        for i in range(args.n_gen):
            model(ids[:, i : i + 1], past_key_values=cache, use_cache=True)
        return time.perf_counter() - start

    with torch.inference_mode():
        return {
            "engine": f"transformers {transformers.__version__} ({args.transformers_dtype}, "
            f"{source})",
            "pp": timed_runs(args.repetitions, pp),
            "tg": timed_runs(args.repetitions, tg),
        }


WORKERS = {"llama.cpp": worker_llama_cpp, "transformers": worker_transformers}


def run_llmrun(args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "llmrun", "bench", args.model, "-o", "json"]
    command += ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-t", str(args.threads)]
    command += ["-r", str(args.repetitions)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr.strip().splitlines()[-1])
    records = {("pp" if r["n_prompt"] else "tg"): r for r in json.loads(result.stdout)}
    first = records["pp"]
    return {
        "engine": f"llmrun {first['llmrun_version']} ({first['quant']}, {first['dtype']})",
        "pp": [args.n_prompt / ts for ts in records["pp"]["samples_ts"]],
        "tg": [args.n_gen / ts for ts in records["tg"]["samples_ts"]],
    }


def run_peer(engine: str, python: str, args: argparse.Namespace) -> dict:
    try:
        check = subprocess.run([python, "-c", f"import {MODULES[engine]}"], capture_output=True)
    except OSError as e:
        raise RuntimeError(f"cannot run {python}: {e.strerror}") from None
    if check.returncode:
        raise RuntimeError(f"{MODULES[engine]} is not importable by {python}")
    command = [python, __file__, args.model, "--worker", engine]
    command += ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-t", str(args.threads)]
    command += ["-r", str(args.repetitions), "--transformers-dtype", args.transformers_dtype]
    command += ["--hf-dir", args.hf_dir] if args.hf_dir else []
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        lines = result.stderr.strip().splitlines() or [f"exit code {result.returncode}"]
        raise RuntimeError(lines[-1])
    return json.loads(result.stdout.strip().splitlines()[-1])


def rates(seconds: list[float], tokens: int) -> tuple[float, float]:
    samples = [tokens / s for s in seconds]
    return statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0


def table(results: list[dict], args: argparse.Namespace) -> str:
    pp, tg = f"pp{args.n_prompt}", f"tg{args.n_gen}"
    lines = [
        f"| engine | {pp} t/s | {tg} t/s | llmrun / engine, {pp} | llmrun / engine, {tg} |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    ours = next((r for r in results if r["engine"].startswith("llmrun")), None)
    for r in results:
        cells = [r["engine"]]
        for key, tokens in (("pp", args.n_prompt), ("tg", args.n_gen)):
            mean, sd = rates(r[key], tokens)
            cells.append(f"{mean:.2f} ± {sd:.2f}")
        for key, tokens in (("pp", args.n_prompt), ("tg", args.n_gen)):
            ratio = rates(ours[key], tokens)[0] / rates(r[key], tokens)[0] if ours else None
            cells.append("-" if ratio is None else f"{ratio:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a .gguf file")
    parser.add_argument("-p", "--n-prompt", type=int, default=512)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("-t", "--threads", type=int, default=threads)
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma list of engines")
    parser.add_argument("--llama-cpp-python", default=sys.executable, help="its interpreter")
    parser.add_argument("--transformers-python", default=sys.executable, help="its interpreter")
    parser.add_argument("--transformers-dtype", choices=("bf16", "f32"), default="bf16")
    parser.add_argument("--hf-dir", help="an HF directory for transformers instead of the GGUF")
    parser.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if min(args.n_prompt, args.n_gen, args.threads, args.repetitions) < 1:
        parser.error("-p, -n, -t and -r must be positive")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
        return
    pythons = {"llama.cpp": args.llama_cpp_python, "transformers": args.transformers_python}
    results, notes = [], []
    for engine in args.engines.split(","):
        print(f"running {engine} ...", file=sys.stderr, flush=True)
        try:
            if engine == "llmrun":
                results.append(run_llmrun(args))
            else:
                results.append(run_peer(engine, pythons[engine], args))
        except RuntimeError as e:
            notes.append(f"{engine} skipped: {e}")
    print(
        f"{Path(args.model).name}, {args.threads} threads, mean ± sd of {args.repetitions} "
        "runs after a warm-up\n"
    )
    print(table(results, args))
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
