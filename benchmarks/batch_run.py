"""`llmrun run --batch` against a shell loop of `llmrun run`, and against `llmrun serve`.

Makes N short prompts (distinct, deterministic), then measures:
- batch: one `llmrun run MODEL --batch prompts.txt --batch-lines -n 16 --parallel P`
  process, wall time from start to exit (interpreter, torch import and model load
  included), and the tokens/s of its generation (from its `--verbose` summary);
- loop: `while read p; do llmrun run MODEL "$p" -n 16 --json </dev/null; done` in bash,
  over the first --loop prompts (default all; fewer are timed and scaled up to N, said so);
- serve: `llmrun serve MODEL --parallel P`, then P clients sending the N prompts as
  /v1/completions requests (same tokens, greedy), tokens/s over the clients' wall time.
All greedy and `--raw` (the prompt as is, as /v1/completions takes it), so the loop's and
serve's texts must equal the batch's: a mismatch is reported. An untimed run first builds
the native kernels if they are not cached. Prints the ratios: loop wall / batch wall, batch tokens/s / serve tokens/s.

Usage:
  python benchmarks/batch_run.py [MODEL] [-N 1000] [-n 16] [--parallel 4] [--loop 100]
      [-t THREADS] [--skip-serve] [--json]
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SUBJECTS = ["Lily", "Tom", "The little dog", "A big bird", "The old man", "Sue", "Max", "The cat"]
ACTIONS = ["went to the", "saw a", "wanted to find the", "liked the", "was afraid of the"]
THINGS = ["park", "tree", "ball", "river", "house", "cake", "moon", "garden", "box", "car"]
SUMMARY = re.compile(r"(\d+) prompts, (\d+) tokens generated in ([\d.]+) s, ([\d.]+) tokens/s")


def prompts(n: int) -> list[str]:
    """n distinct short prompts (a few tokens each), the same on every run."""
    out = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        action = ACTIONS[(i // len(SUBJECTS)) % len(ACTIONS)]
        thing = THINGS[(i // (len(SUBJECTS) * len(ACTIONS))) % len(THINGS)]
        round_ = i // (len(SUBJECTS) * len(ACTIONS) * len(THINGS))
        out.append(f"{subject} {action} {thing}" + (f" {round_}" if round_ else ""))
    return out


def llmrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmrun", *args]


def model_args(args: argparse.Namespace) -> list[str]:
    return [args.model] if args.model else []


def common(args: argparse.Namespace) -> list[str]:
    threads = ["--threads", str(args.threads)] if args.threads else []
    # --raw: the prompt as is, as /v1/completions takes it, so all three see the same tokens.
    return ["-n", str(args.max_tokens), "--temperature", "0", "--raw", *threads]


def run_batch(args: argparse.Namespace, path: Path) -> dict:
    command = llmrun("run", *model_args(args), "--batch", str(path), "--batch-lines")
    command += [*common(args), "--parallel", str(args.parallel), "--verbose"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"llmrun run --batch failed:\n{done.stderr}")
    summary = SUMMARY.search(done.stderr)
    texts = [json.loads(line)["text"] for line in done.stdout.splitlines()]
    return {
        "wall_seconds": wall,
        "tokens": int(summary.group(2)),
        "generation_seconds": float(summary.group(3)),
        "tokens_per_second": float(summary.group(4)),
        "texts": texts,
    }


def run_loop(args: argparse.Namespace, path: Path, count: int) -> dict:
    flags = " ".join(f"'{a}'" for a in [*model_args(args), *common(args)])
    python = sys.executable
    # </dev/null: run would read the loop's remaining lines as more prompt.
    script = (
        f'head -n {count} "$1" | while IFS= read -r p; do '
        f'"{python}" -m llmrun run {flags} "$p" --json </dev/null || exit 1; done'
    )
    start = time.perf_counter()
    done = subprocess.run(["bash", "-c", script, "loop", str(path)], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"the shell loop of llmrun run failed:\n{done.stderr}")
    return {
        "prompts": count,
        "wall_seconds": wall,
        "texts": [json.loads(line)["text"] for line in done.stdout.splitlines()],
    }


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    command = llmrun("serve", *model_args(args), "--port", "0", "--parallel", str(args.parallel))
    command += ["--queue", str(max(args.prompts, 1))]
    if args.threads:
        command += ["--threads", str(args.threads)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"the server exited:\n{log.read_text()}")
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if found:
            try:
                if httpx.get(f"{found.group(1)}/health").status_code == 200:
                    return process, found.group(1)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    process.kill()
    sys.exit(f"the server did not become ready:\n{log.read_text()}")


def run_serve(args: argparse.Namespace, texts: list[str]) -> dict:
    import httpx

    process, url = start_server(args, Path(tempfile.mkdtemp()) / "serve.log")
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(texts)):
        todo.put(i)
    results: list[dict | None] = [None] * len(texts)

    def ask(client: httpx.Client, prompt: str) -> dict:
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
        response = client.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()

    def client_loop() -> None:
        with httpx.Client() as client:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                results[i] = ask(client, texts[i])

    try:
        with httpx.Client() as client:
            ask(client, texts[0])  # warm-up
        clients = [threading.Thread(target=client_loop) for _ in range(args.parallel)]
        start = time.perf_counter()
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        wall = time.perf_counter() - start
    finally:
        process.terminate()
        process.wait(30)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {
        "wall_seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall,
        "texts": [r["choices"][0]["text"] for r in results],
    }


def mismatches(expected: list[str], got: list[str]) -> int:
    return sum(a != b for a, b in zip(expected, got, strict=False)) + abs(len(expected) - len(got))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="MODEL (default: the bundled stories260K)")
    parser.add_argument("-N", "--prompts", type=int, default=1000, help="prompts in the batch")
    parser.add_argument("-n", "--max-tokens", type=int, default=16, help="new tokens per prompt")
    parser.add_argument("--parallel", type=int, default=4, help="slots for --batch and serve")
    parser.add_argument("--loop", type=int, help="prompts the shell loop runs (default: all)")
    parser.add_argument("-t", "--threads", type=int, help="CPU threads for every process")
    parser.add_argument("--skip-serve", action="store_true", help="leave out the serve run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    texts = prompts(args.prompts)
    path = Path(tempfile.mkdtemp()) / "prompts.txt"
    path.write_text("".join(t + "\n" for t in texts))
    # Once untimed: builds the native kernels for this CPU if they are not cached yet.
    subprocess.run(llmrun("run", *model_args(args), "Hi", *common(args)), capture_output=True)
    batch = run_batch(args, path)
    count = min(args.loop or args.prompts, args.prompts)
    loop = run_loop(args, path, count)
    loop_wall = loop["wall_seconds"] * args.prompts / count  # scaled to all N prompts
    serve = None if args.skip_serve else run_serve(args, texts)
    report = {
        "model": args.model or "stories260K (bundled)",
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "parallel": args.parallel,
        "batch_wall_seconds": round(batch["wall_seconds"], 3),
        "batch_tokens": batch["tokens"],
        "batch_tokens_per_second": batch["tokens_per_second"],
        "loop_prompts_timed": count,
        "loop_wall_seconds": round(loop_wall, 3),
        "loop_over_batch": round(loop_wall / batch["wall_seconds"], 2),
        "loop_mismatches": mismatches(batch["texts"][:count], loop["texts"]),
    }
    if serve is not None:
        report["serve_tokens_per_second"] = round(serve["tokens_per_second"], 1)
        report["batch_over_serve"] = round(
            batch["tokens_per_second"] / serve["tokens_per_second"], 2
        )
        report["serve_mismatches"] = mismatches(batch["texts"], serve["texts"])
    if args.json:
        print(json.dumps(report))
        return
    scaled = f" ({count} timed, scaled to {args.prompts})" if count < args.prompts else ""
    print(
        f"model {report['model']}, {args.prompts} prompts, {args.max_tokens} new tokens each, "
        f"--parallel {args.parallel}"
    )
    print(
        f"run --batch: {batch['wall_seconds']:.2f} s wall, {batch['tokens_per_second']:.1f} tokens/s"
    )
    print(f"shell loop of run: {loop_wall:.2f} s wall{scaled}")
    print(f"loop / batch wall time: {report['loop_over_batch']:.2f}x")
    if serve is not None:
        print(f"serve, {args.parallel} clients: {serve['tokens_per_second']:.1f} tokens/s")
        print(f"batch / serve tokens/s: {report['batch_over_serve']:.2f}x")
    bad = report["loop_mismatches"] + report.get("serve_mismatches", 0)
    if bad:
        print(f"warning: {bad} texts differ from the batch's (greedy runs should agree)")


if __name__ == "__main__":
    main()
