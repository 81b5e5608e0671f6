"""Load test of `llmrun serve`: concurrent streaming clients, throughput and latency.

Starts `llmrun serve MODEL` on 127.0.0.1 (or uses --url), then for each
concurrency level runs that many clients at once, each making --requests
streaming /v1/completions requests one after another, with fixed-length
outputs (ignore_eos) so every level does the same work per request. Reports per
level: aggregate generated tokens/s (all completion tokens / wall time), time to
first token and per-token latency (gaps between streamed chunks) at P50 and P99,
and the server's peak RSS so far (VmHWM, when it was started here). Ends with
the aggregate throughput of the highest level relative to one client.

--multi-turn USERSxTURNS (say 8x8) runs a chat workload instead: each simulated
user sends TURNS streaming /v1/chat/completions requests one after another, each
carrying the whole conversation so far (growing by the previous answer and a new
user message), with --think-time seconds between a reply and the next turn. It
reports TTFT and inter-token latency P50/P99, aggregate generated tokens/s, and
the share of prompt tokens the server served from its prefix cache
(usage.prompt_tokens_details.cached_tokens), with the prefix cache on and off
(--prefix-cache on|off|both; a server started here gets --no-prefix-cache for off).
It also samples, every 50 ms, how many requests the server is running (llmrun's
/health `running`; llama-server's /slots `is_processing`), for the concurrency a
KV budget holds (--kv-memory and --cache-type here; -c and --kv-unified there), and
counts the requests that failed (a user whose request fails stops there).

Usage:
  python benchmarks/serve_load.py [MODEL] [-c 1,4,8] [--requests 4] [-n 64]
      [--parallel 8] [--threads 2] [--prompt TEXT] [--url http://127.0.0.1:8080]
  python benchmarks/serve_load.py [MODEL] --multi-turn 8x8 [-n 64] [--think-time 0.5]
      [--prefix-cache both] [--kv-memory 1GiB] [--cache-type f16] [--activations q8]
      [--parallel 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def start_server(
    args: argparse.Namespace, log: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "llmrun", "serve", "--port", "0"]
    command += ["--parallel", str(args.parallel), "--queue", "256", *extra]
    if args.kv_memory:
        command += ["--kv-memory", args.kv_memory]
    if args.activations:
        command += ["--activations", args.activations]
    if args.cache_type:
        command += ["--cache-type", args.cache_type]
    if args.model:
        command.append(args.model)
    if args.threads:
        command += ["--threads", str(args.threads)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"the server exited:\n{log.read_text()}")
        found = url or re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if found:
            url = found if isinstance(found, str) else found.group(1)
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return process, url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    process.kill()
    sys.exit(f"the server did not become ready:\n{log.read_text()}")


def peak_rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return None
    found = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
    return int(found.group(1)) * 1024 if found else None


def one_request(client: httpx.Client, url: str, args: argparse.Namespace) -> dict:
    body = {
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
    return {"ttft": first, "gaps": gaps, "tokens": tokens}


def run_level(url: str, clients: int, args: argparse.Namespace) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client() as client:
            for _ in range(args.requests):
                result = one_request(client, url, args)
                with lock:
                    results.append(result)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(gaps, 50),
        "tpot_p99": percentile(gaps, 99),
        "per_stream_tps": statistics.mean(1 / g for g in gaps) if gaps else float("nan"),
    }


USER_TURNS = [
    "Tell me a story about a cat.",
    "What happened next?",
    "Why did it do that?",
    "Tell me more about its friend.",
    "How did the day end?",
    "What did they learn?",
    "Tell it again, but shorter.",
    "Give the story a title.",
]


def chat_turn(client: httpx.Client, url: str, messages: list[dict], args) -> dict:
    """One streamed chat request: TTFT, gaps between chunks, the answer and usage."""
    body = {
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, last, gaps, pieces, usage = None, None, [], [], {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            return {"error": f"{response.status_code}: {response.read().decode()[:200]}"}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])[:200]}
            usage = chunk.get("usage") or usage
            if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                continue
            pieces.append(chunk["choices"][0]["delta"]["content"])
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
    return {"ttft": first, "gaps": gaps, "answer": "".join(pieces), "usage": usage}


def running(client: httpx.Client, url: str) -> int | None:
    """Requests the server is running now: llmrun's /health, else llama-server's /slots."""
    try:
        health = client.get(f"{url}/health", timeout=5).json()
        if "running" in health:
            return health["running"]
        slots = client.get(f"{url}/slots", timeout=5).json()
        return sum(1 for slot in slots if slot.get("is_processing"))
    except (httpx.HTTPError, ValueError, TypeError, AttributeError):
        return None


def run_conversations(url: str, users: int, turns: int, args) -> dict:
    results: list[dict] = []
    errors: list[str] = []
    samples: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def user(index: int) -> None:
        messages = [{"role": "system", "content": f"You are storyteller number {index}."}]
        with httpx.Client() as client:
            for turn in range(turns):
                messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
                result = chat_turn(client, url, messages, args)
                with lock:
                    if "error" in result:
                        errors.append(result["error"])
                        return
                    results.append(result)
                messages.append({"role": "assistant", "content": result["answer"]})
                time.sleep(args.think_time)

    def sample() -> None:
        with httpx.Client() as client:
            while not done.wait(0.05):
                count = running(client, url)
                if count is not None:
                    samples.append(count)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    sampler = threading.Thread(target=sample)
    start = time.perf_counter()
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in results)
    prompt = sum(r["usage"].get("prompt_tokens", 0) for r in results)
    cached = sum(
        (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results
    )
    return {
        "users": users,
        "turns": turns,
        "requests": len(results),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": cached / prompt if prompt else float("nan"),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "running_max": max(samples, default=0),
        "running_mean": statistics.mean(samples) if samples else float("nan"),
    }


def conversation_table(rows: list[dict]) -> str:
    lines = [
        "| prefix cache | users x turns | tokens | agg tok/s | TTFT P50 / P99 (ms) "
        "| ITL P50 / P99 (ms) | cached / prompt tokens | running max / mean | failed "
        "| peak RSS (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        rss = f"{r['peak_rss'] / 2**20:.0f}" if r.get("peak_rss") else "-"
        lines.append(
            f"| {r['prefix_cache']} | {r['users']} x {r['turns']} | {r['tokens']} "
            f"| {r['tokens_per_second']:.1f} "
            f"| {r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f} "
            f"| {r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f} "
            f"| {r['cached_tokens']} / {r['prompt_tokens']} ({r['cached_ratio']:.0%}) "
            f"| {r['running_max']} / {r['running_mean']:.1f} | {r['failed']} | {rss} |"
        )
    errors = [r["first_error"] for r in rows if r["first_error"]]
    return "\n".join(lines + [f"first error: {e}" for e in errors])


def multi_turn(args: argparse.Namespace) -> None:
    match = re.fullmatch(r"(\d+)x(\d+)", args.multi_turn)
    if match is None:
        sys.exit(f"--multi-turn takes USERSxTURNS, such as 8x8; got {args.multi_turn!r}")
    users, turns = int(match[1]), int(match[2])
    modes = ["on", "off"] if args.prefix_cache == "both" else [args.prefix_cache]
    rows = []
    for mode in modes:
        process = None
        if args.url:
            url = args.url.rstrip("/")
        else:
            log = Path(tempfile.mkdtemp()) / "serve.log"
            process, url = start_server(args, log, () if mode == "on" else ("--no-prefix-cache",))
        try:
            chat_turn(httpx.Client(), url, [{"role": "user", "content": "Hi"}], args)  # warm-up
            row = {"prefix_cache": mode, **run_conversations(url, users, turns, args)}
            row["peak_rss"] = peak_rss(process.pid if process else None)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
        finally:
            if process is not None:
                process.terminate()
                process.wait(30)
    if not args.json:
        model = args.model or "stories260K (bundled)"
        print(
            f"model {model}, {args.parallel} sequences, {users} users x {turns} turns, "
            f"up to {args.max_tokens} tokens a reply, think time {args.think_time}s, "
            f"threads {args.threads or os.cpu_count()}"
        )
        print(conversation_table(rows))


def table(rows: list[dict]) -> str:
    lines = [
        "| clients | requests | tokens | agg tok/s | TTFT P50 / P99 (ms) "
        "| per-token P50 / P99 (ms) | peak RSS (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        rss = f"{r['peak_rss'] / 2**20:.0f}" if r.get("peak_rss") else "-"
        lines.append(
            f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['tokens_per_second']:.1f} "
            f"| {r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f} "
            f"| {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p99'] * 1e3:.1f} | {rss} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="MODEL for llmrun serve (default: bundled)")
    parser.add_argument("-c", "--concurrency", default="1,4,8", help="client counts")
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--prompt", default="Once upon a time, there was a little girl who")
    parser.add_argument("--parallel", type=int, default=8, help="server slots")
    parser.add_argument("-t", "--threads", type=int, help="server CPU threads")
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument("--json", action="store_true", help="print JSON lines, not a table")
    parser.add_argument("--multi-turn", metavar="USERSxTURNS", help="the chat workload, e.g. 8x8")
    parser.add_argument("--think-time", type=float, default=0.5, help="seconds between turns")
    parser.add_argument("--prefix-cache", choices=["on", "off", "both"], default="both")
    parser.add_argument("--kv-memory", help="the server's --kv-memory")
    parser.add_argument("--activations", choices=["f32", "q8"], help="the server's --activations")
    parser.add_argument("--cache-type", help="the server's --cache-type")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.multi_turn:
        multi_turn(args)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    process = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        log = Path(tempfile.mkdtemp()) / "serve.log"
        process, url = start_server(args, log)
    try:
        one_request(httpx.Client(), url, args)  # warm-up
        rows = []
        for clients in levels:
            row = run_level(url, clients, args)
            row["peak_rss"] = peak_rss(process.pid if process else None)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    if not args.json:
        model = args.model or "stories260K (bundled)"
        print(
            f"model {model}, {args.parallel} slots, {args.requests} requests per client, "
            f"{args.max_tokens} tokens each, threads {args.threads or os.cpu_count()}"
        )
        print(table(rows))
    base = next((r for r in rows if r["clients"] == 1), None)
    if base and len(rows) > 1:
        top = rows[-1]
        ratio = top["tokens_per_second"] / base["tokens_per_second"]
        print(f"aggregate throughput, {top['clients']} clients vs 1: {ratio:.2f}x")


if __name__ == "__main__":
    main()
