"""Tokenizer speed: building from GGUF metadata, batch against per-line encoding, the CLI.

    python benchmarks/tokenize_speed.py [--vocab-dir DIR] [--mb 4] [--threads 1,2,0] [-r 3]
                                        [--build-only]

Reads llama.cpp's vocabularies (`python tests/data/fetch.py` puts them in
tests/data/cache/vocab/) and prints three tables:

- build: CPU seconds (the least of -r runs; CPU time, as other work on the machine stretches
  wall time) for `Tokenizer.from_gguf_metadata` on each vocabulary, the GGUF header read
  (`read_gguf`) apart: as llmrun builds it (merging in C, llmrun.gguf_bpe), as it builds it
  where the C library cannot be built (the `tokenizers` library's BPE), and the library's
  own `BPE(vocab, merges)` constructor, the floor of that second way. "spm-262k" is Gemma 4's
  262,144 tokens given SentencePiece scores (-id), standing in for Gemma 3's vocabulary.
- batch: texts/s and tokens/s for --mb MB of text (llama.cpp's test strings, CJK text and
  the sources of Python's standard library; one text per line), encoded by a plain
  per-line loop of `encode` and by `encode_batch` with each --threads value (0: all cores).
  Each thread count runs in a subprocess of its own, since the tokenizers library sizes its
  thread pool once per process.
- cli: wall seconds of `llmrun tokenize VOCAB "Hello world"` and of `--batch` over the text.

The figures and the text's size go to benchmarks/out/tokenize_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
BUILD_VOCABS = ["gpt-2", "llama-spm", "llama-bpe", "qwen2", "command-r", "gemma-4"]
BATCH_VOCABS = ["llama-bpe", "qwen2", "gemma-4", "llama-spm"]


def best(fn, repeat: int, clock=time.perf_counter) -> float:
    """The least time of `repeat` calls; what `fn` returns is freed after the clock stops."""
    times = []
    for _ in range(repeat):
        start = clock()
        result = fn()
        times.append(clock() - start)
        del result
    return min(times)


def cpu_best(fn, repeat: int) -> float:
    return best(fn, repeat, time.process_time)


def corpus(vocab_dir: Path, megabytes: float) -> list[str]:
    """Non-blank lines adding up to `megabytes`: llama.cpp's test strings (many languages),
    CJK text from Python's own tests, then Python's standard library sources."""
    lib = Path(os.__file__).parent
    files = sorted(vocab_dir.glob("*.inp")) + sorted((lib / "test" / "cjkencodings").glob("*utf8*"))
    files += sorted(lib.glob("*.py")) + sorted(lib.glob("*/*.py"))
    out, size = [], 0
    for file in files:
        for line in file.read_bytes().decode("utf-8", "replace").split("\n"):
            if line.strip() and line != "__ggml_vocab_test__":
                out.append(line)
                size += len(line.encode())
                if size >= megabytes * 1e6:
                    return out
    return out


def build_times(vocab_dir: Path, repeat: int) -> list[dict]:
    from tokenizers.models import BPE

    from llmrun import native, tokenizer_gguf
    from llmrun.loading.gguf_io import read_gguf
    from llmrun.spm_merges import spm_merges
    from llmrun.tokenizer import Tokenizer

    rows = []
    for name in BUILD_VOCABS + ["spm-262k"]:
        path = vocab_dir / f"ggml-vocab-{'gemma-4' if name == 'spm-262k' else name}.gguf"
        if not path.is_file():
            continue
        read = cpu_best(lambda: read_gguf(path, with_tensors=False), repeat)  # noqa: B023
        meta = read_gguf(path, with_tensors=False).metadata
        if name == "spm-262k":
            meta = {k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"}
            meta["tokenizer.ggml.model"] = "llama"
            meta["tokenizer.ggml.scores"] = [
                -float(i) for i in range(len(meta["tokenizer.ggml.tokens"]))
            ]
        build = cpu_best(lambda: Tokenizer.from_gguf_metadata(meta, str(path)), repeat)  # noqa: B023
        merging = native.tokenize_library
        native.tokenize_library = lambda: None
        without_c = cpu_best(lambda: Tokenizer.from_gguf_metadata(meta, str(path)), repeat)  # noqa: B023
        native.tokenize_library = merging
        # The same vocabulary and merges as the build gives the library.
        vocab = tokenizer_gguf._gguf_vocab(meta["tokenizer.ggml.tokens"])
        if meta["tokenizer.ggml.model"] == "llama":
            merges = spm_merges(vocab, meta["tokenizer.ggml.scores"])
        else:
            merges = tokenizer_gguf._split_merges(meta["tokenizer.ggml.merges"])
        library = cpu_best(lambda: BPE(vocab, merges), repeat)  # noqa: B023
        rows.append(
            {
                "vocab": name,
                "tokens": len(meta["tokenizer.ggml.tokens"]),
                "merges": len(merges),
                "read_s": read,
                "build_s": build,
                "library_s": without_c,
                "bpe_s": library,
            }
        )
    return rows


def batch_child(vocab: str, lines_file: str, threads: str, repeat: int) -> None:
    """Runs in a subprocess: prints one JSON row for one vocabulary and thread count."""
    from llmrun.tokenizer import load_tokenizer

    texts = Path(lines_file).read_bytes().decode().split("\n")
    tok = load_tokenizer(vocab)
    if threads == "loop":
        ids = [tok.encode(t) for t in texts]
        seconds = best(lambda: [tok.encode(t) for t in texts], repeat)
    else:
        n = int(threads) or None
        ids = tok.encode_batch(texts, threads=n)
        seconds = best(lambda: tok.encode_batch(texts, threads=n), repeat)
    tokens = sum(map(len, ids))
    print(json.dumps({"seconds": seconds, "texts": len(texts), "tokens": tokens}))


def batch_rates(vocab_dir: Path, lines_file: Path, threads: list[str], repeat: int) -> list[dict]:
    rows = []
    for name in BATCH_VOCABS:
        path = vocab_dir / f"ggml-vocab-{name}.gguf"
        if not path.is_file():
            continue
        for mode in ["loop", *threads]:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(path),
                    str(lines_file),
                    mode,
                    str(repeat),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout)
            label = "per-line encode" if mode == "loop" else f"encode_batch, threads={mode}"
            rows.append(
                {
                    "vocab": name,
                    "how": label.replace("threads=0", "threads=all"),
                    "texts_per_s": row["texts"] / row["seconds"],
                    "tokens_per_s": row["tokens"] / row["seconds"],
                    "seconds": row["seconds"],
                }
            )
    return rows


def cli_times(vocab_dir: Path, lines_file: Path, repeat: int) -> list[dict]:
    path = vocab_dir / "ggml-vocab-llama-bpe.gguf"
    if not path.is_file():
        return []
    llmrun = [sys.executable, "-m", "llmrun", "tokenize", str(path)]
    check = "import sys, llmrun.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)

    def one() -> None:
        subprocess.run([*llmrun, "Hello world"], capture_output=True, check=True)

    def batch() -> None:
        with lines_file.open("rb") as stdin:
            subprocess.run([*llmrun, "--batch"], stdin=stdin, capture_output=True, check=True)

    return [
        {"command": "llmrun tokenize llama-bpe 'Hello world'", "seconds": best(one, repeat)},
        {"command": "llmrun tokenize llama-bpe --batch < text", "seconds": best(batch, repeat)},
    ]


def table(rows: list[dict], columns: dict[str, str]) -> str:
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        cells = []
        for key in columns:
            value = row[key]
            if isinstance(value, float):
                value = f"{value:,.3f}" if value < 100 else f"{value:,.0f}"
            cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-dir", type=Path, default=ROOT / "tests/data/cache/vocab")
    parser.add_argument("--mb", type=float, default=4.0, help="MB of text for the batch runs")
    parser.add_argument("--threads", default="1,2,0", help="encode_batch thread counts")
    parser.add_argument("-r", "--repeat", type=int, default=3)
    parser.add_argument("--build-only", action="store_true", help="only the build table")
    args = parser.parse_args()
    if not any(args.vocab_dir.glob("ggml-vocab-*.gguf")):
        sys.exit(f"no ggml-vocab-*.gguf in {args.vocab_dir}: run python tests/data/fetch.py")
    OUT.mkdir(parents=True, exist_ok=True)
    texts = corpus(args.vocab_dir, args.mb)
    lines_file = OUT / "tokenize-lines.txt"
    lines_file.write_bytes("\n".join(texts).encode())
    size = lines_file.stat().st_size
    print(f"{len(texts):,} lines, {size / 1e6:.1f} MB; {os.cpu_count()} CPUs\n")

    build = build_times(args.vocab_dir, args.repeat)
    print(
        table(
            build,
            {
                "vocab": "vocab",
                "tokens": "tokens",
                "merges": "merges",
                "read_s": "read_gguf CPU s",
                "build_s": "from_gguf_metadata CPU s",
                "library_s": "without C: library's BPE CPU s",
                "bpe_s": "of which BPE() CPU s",
            },
        )
    )
    rates: list[dict] = []
    cli: list[dict] = []
    if not args.build_only:
        rates = batch_rates(args.vocab_dir, lines_file, args.threads.split(","), args.repeat)
        print()
        print(
            table(
                rates,
                {
                    "vocab": "vocab",
                    "how": "how",
                    "texts_per_s": "texts/s",
                    "tokens_per_s": "tokens/s",
                    "seconds": "s",
                },
            )
        )
        cli = cli_times(args.vocab_dir, lines_file, args.repeat)
        print()
        print(table(cli, {"command": "command", "seconds": "wall s"}))
    record = {
        "lines": len(texts),
        "bytes": size,
        "cpus": os.cpu_count(),
        "build": build,
        "batch": rates,
        "cli": cli,
    }
    (OUT / "tokenize_speed.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        batch_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
