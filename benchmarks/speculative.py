"""Speculative decoding's speed: decode tokens/s without drafts, with a draft model and
with prompt lookup, and the share of drafts accepted, for llmrun and llama-server on
the same files in the same run.

    python benchmarks/speculative.py [--model M.gguf --draft D.gguf] [-n 128] [-t 2] \\
        [--draft-max 3] [--lookup 8] [--llama-server /tmp/llama-cpp-avx512/bin/llama-server]

Without --model it writes (once, into benchmarks/out) a Qwen2.5-0.5B-shaped random Q8_0
file and, as the smaller draft, the same file cut to its first 4 layers (make_qwen_model
draws the tensors in order from one seed, so the first layers, the embedding and the
norm are the target's: a layer-skip draft). Cases, each greedy with end-of-text ignored:

- plain: no drafts;
- draft = model: the target drafts for itself, the upper bound (every draft accepted;
  the speed-up is what a verify forward of k + 1 tokens saves over k + 1 decode steps);
- draft = 4 layers: a cheaper draft (on random weights the acceptance says little:
  pass a real pair, e.g. Qwen2.5-7B with Qwen2.5-0.5B, for meaningful numbers);
- lookup: prompt lookup on a prompt that repeats itself (llama-server:
  `--spec-type ngram-simple` with 3-token keys).

llama-server drafts with `-md D --spec-type draft-simple --spec-draft-n-max N` (its
flags since the `--draft-max` rename; an older binary needs `--draft-max N`).

Each case runs -r times after a warm-up; t/s is the mean of the runs' decode rates
(llmrun: Stats.generation_tps; llama-server: timings.predicted_per_second), acceptance
the accepted/drafted counts summed (llama-server: draft_n_accepted / draft_n).

With --serve, both run as servers with one client: `llmrun serve M --parallel 1
[--draft D --draft-max N | --lookup N]` against `llama-server -m M --parallel 1` with
the flags above, each case a server of its own. One client streams greedy
/v1/completions (ignore_eos) one at a time; t/s is measured by the client alike for
both, the tokens after the first over the time from the first chunk to the last;
acceptance from llmrun's usage.completion_tokens_details and llama-server's final
timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_qwen_model import SHAPES, VOCAB, write  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402

PROMPT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. "
)
REPEATED = (
    "def total(values):\n    result = 0\n    for value in values:\n        result += value\n"
    "    return result\n\n"
) * 4 + "Rewrite the function above with the name `sum_all`:\n"
DRAFT_LAYERS = 4


def default_files(out: Path) -> tuple[Path, Path]:
    """The Qwen2.5-0.5B-shaped Q8_0 file and its first DRAFT_LAYERS layers, written once."""
    if not VOCAB.is_file():
        sys.exit(f"{VOCAB} is missing: run python tests/data/fetch.py")
    out.mkdir(parents=True, exist_ok=True)
    model = out / "qwen2.5-0.5b-shaped-Q8_0.gguf"
    draft = out / f"qwen2.5-0.5b-shaped-{DRAFT_LAYERS}-layers-Q8_0.gguf"
    if not model.is_file():
        write(model, "Q8_0")
    if not draft.is_file():
        write(draft, "Q8_0", dataclasses.replace(SHAPES["0.5b"], layers=DRAFT_LAYERS))
    return model, draft


def llmrun_case(engine, prompt: str, tokens: int, repetitions: int) -> tuple[float, float | None]:
    """(mean decode t/s, acceptance or None) of greedy generations of `tokens` tokens."""
    from llmrun.sampling import SamplingParams

    ids = engine.tokenizer.encode(prompt)
    greedy = SamplingParams(temperature=0)
    rates, drafted, accepted = [], 0, 0
    for rep in range(repetitions + 1):
        final = list(engine.generate(ids, greedy, tokens))[-1]
        if rep:
            rates.append(final.stats.generation_tps)
            drafted += final.stats.drafted
            accepted += final.stats.accepted
    return statistics.fmean(rates), accepted / drafted if drafted else None


def llama_case(
    binary: Path, model: Path, extra: tuple[str, ...], prompt: str, args: argparse.Namespace
) -> tuple[float, float | None]:
    """llama-server's (mean decode t/s, acceptance or None) for the same case."""
    log = args.out / "speculative-llama-server.log"
    server = Server(binary, model, log, ("-c", "2048", "-t", str(args.threads), *extra))
    try:
        body = dict(
            prompt=prompt,
            n_predict=args.n_gen,
            temperature=0,
            top_k=1,
            ignore_eos=True,
            cache_prompt=False,
        )
        rates, drafted, accepted = [], 0, 0
        for rep in range(args.repetitions + 1):
            timings = server._post("/completion", body)["timings"]
            if rep:
                rates.append(timings["predicted_per_second"])
                drafted += timings.get("draft_n", 0)
                accepted += timings.get("draft_n_accepted", 0)
    finally:
        server.close()
    return statistics.fmean(rates), accepted / drafted if drafted else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_case(
    command: list[str], port: int, prompt: str, args: argparse.Namespace, log: Path
) -> tuple[float, float | None]:
    """(mean decode t/s seen by one streaming client, acceptance or None) of a server
    started by `command` on `port`, over -r greedy completions after a warm-up."""
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"{command[0]} did not start:\n" + "\n".join(tail))
            time.sleep(0.2)
        rates, drafted, accepted = [], 0, 0
        for rep in range(args.repetitions + 1):
            rate, counts = _stream(port, prompt, args.n_gen)
            if rep:
                rates.append(rate)
                drafted += counts[0]
                accepted += counts[1]
    finally:
        process.terminate()
        process.wait(30)
    return statistics.fmean(rates), accepted / drafted if drafted else None


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stream(port: int, prompt: str, tokens: int) -> tuple[float, tuple[int, int]]:
    """One streamed greedy completion of `tokens` tokens: its decode rate (the tokens
    after the first over the time from the first chunk to the last) and (drafted,
    accepted) as the server reports them."""
    body = dict(
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        cache_prompt=False,
    )
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first = last = None
    drafted = accepted = 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if any(choice.get("text") for choice in chunk.get("choices", [])):
            last = time.perf_counter()
            first = first or last
        details = (chunk.get("usage") or {}).get("completion_tokens_details") or {}
        if "accepted_prediction_tokens" in details:  # llmrun
            accepted = details["accepted_prediction_tokens"]
            drafted = accepted + details["rejected_prediction_tokens"]
        timings = chunk.get("timings") or {}
        if "draft_n" in timings:  # llama-server
            drafted, accepted = timings["draft_n"], timings["draft_n_accepted"]
    connection.close()
    return (tokens - 1) / (last - first), (drafted, accepted)


def peer_flags(draft: Path | str | None, args: argparse.Namespace) -> tuple[str, ...]:
    """llama-server's flags for a case's drafts (a draft .gguf, "lookup" or None)."""
    if draft == "lookup":
        return (
            "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
            "--spec-ngram-simple-size-m", str(args.lookup),
        )  # fmt: skip
    if draft is not None:
        return (
            "-md",
            str(draft),
            "--spec-type",
            "draft-simple",
            "--spec-draft-n-max",
            str(args.draft_max),
        )
    return ()


def serve_rows(model: Path, cases: list, args: argparse.Namespace) -> list:
    """--serve's rows: (case, llmrun serve's result, llama-server's or None)."""
    rows = []
    common = ["--parallel", "1", "-c", "2048", "-t", str(args.threads)]
    for name, prompt, draft in cases:
        ours = [sys.executable, "-m", "llmrun", "serve", str(model), *common]
        if draft == "lookup":
            ours += ["--lookup", str(args.lookup)]
        elif draft is not None:
            ours += ["--draft", str(draft), "--draft-max", str(args.draft_max)]
        port = free_port()
        log = args.out / "speculative-serve.log"
        mine = serve_case([*ours, "--port", str(port)], port, prompt, args, log)
        peer = None
        if args.llama_server is not None:
            theirs = [str(args.llama_server), "-m", str(model), *common, *peer_flags(draft, args)]
            port = free_port()
            log = args.out / "speculative-llama-server.log"
            peer = serve_case([*theirs, "--port", str(port)], port, prompt, args, log)
        rows.append((name, mine, peer))
        print(f"{name}: llmrun serve {mine}, llama-server {peer}", file=sys.stderr)
    return rows


def process_rows(model: Path, cases: list, args: argparse.Namespace) -> list:
    """The in-process rows: (case, llmrun's Engine.generate result, llama-server's or None)."""
    import torch

    from llmrun import api

    torch.set_num_threads(args.threads)
    load = dict(device="cpu", ctx_size=2048, threads=args.threads)
    target = api.load(str(model), **load)
    target = dataclasses.replace(target, eos_ids=[])
    rows = []
    for name, prompt, draft in cases:
        engine = dataclasses.replace(target, speculator=None)
        if draft == "lookup":
            engine.use_lookup(args.lookup)
        elif draft is not None:
            engine.use_draft(api.load(str(draft), **load), args.draft_max)
        ours = llmrun_case(engine, prompt, args.n_gen, args.repetitions)
        theirs = (
            llama_case(args.llama_server, model, peer_flags(draft, args), prompt, args)
            if args.llama_server is not None
            else None
        )
        rows.append((name, ours, theirs))
        print(f"{name}: llmrun {ours}, llama-server {theirs}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="the target .gguf (default: written)")
    parser.add_argument("--draft", type=Path, help="a smaller draft .gguf of its vocabulary")
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("--draft-max", type=int, default=3)
    parser.add_argument("--lookup", type=int, default=8, help="tokens prompt lookup drafts")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary, the peer")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument(
        "--serve", action="store_true", help="llmrun serve against llama-server, one client"
    )
    args = parser.parse_args()
    if (args.model is None) != (args.draft is None):
        parser.error("give --model and --draft together, or neither")
    model, small = (args.model, args.draft) if args.model else default_files(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [
        ("plain", PROMPT, None),
        ("draft = model", PROMPT, model),
        (f"draft = {small.name}", PROMPT, small),
        ("plain, repeating prompt", REPEATED, None),
        ("lookup, repeating prompt", REPEATED, "lookup"),
    ]
    rows = (serve_rows if args.serve else process_rows)(model, cases, args)

    def cell(result: tuple[float, float | None] | None) -> str:
        if result is None:
            return "- | -"
        rate, acceptance = result
        return f"{rate:.2f} | " + ("-" if acceptance is None else f"{acceptance:.0%}")

    plain_rate = rows[0][1][0]
    mode = ", served to one streaming client" if args.serve else ""
    print(f"\n{model.name}, {args.threads} threads, {args.n_gen} tokens, greedy{mode}\n")
    print("| case | llmrun t/s | llmrun accepted | x plain | llama-server t/s | accepted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, ours, theirs in rows:
        base = rows[3][1][0] if "repeating" in name else plain_rate
        print(f"| {name} | {cell(ours)} | {ours[0] / base:.2f} | {cell(theirs)} |")


if __name__ == "__main__":
    main()
