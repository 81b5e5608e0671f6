"""Everything the user sees, and the only module that uses rich.

Generated text goes to stdout as plain text (to a terminal too, so it can be
copied as is); statistics, progress and errors go to stderr, styled only when
stderr is a terminal. Nothing styled ever reaches a pipe.
"""

from __future__ import annotations

import contextlib
import csv
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from llmrun.reasoning import ANSWER, COMMENTARY, REASONING

_stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def error(message: str) -> None:
    """One `error:` line on stderr."""
    if _stderr.is_terminal:
        _stderr.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    else:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()


def warn(message: str) -> None:
    if _stderr.is_terminal:
        _stderr.print(f"[yellow]warning:[/] {message}", markup=True)
    else:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


def info(message: str) -> None:
    """A dim note on stderr (shown in pipes too, unstyled)."""
    if _stderr.is_terminal:
        _stderr.print(message, style="dim", markup=False)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def write(text: str) -> None:
    """Stream a piece of generated text to stdout."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


class ReplyWriter:
    """Streams a reply's pieces to stdout: the reasoning, when shown, between a "Thinking..."
    line and a "...done thinking." line (dim on a terminal, plain in a pipe), then the answer."""

    def __init__(self, show_reasoning: bool) -> None:
        self.show = show_reasoning
        self.tty = stdout_is_tty()
        self.thinking = False

    def _dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.tty and text else text

    def write(self, piece: str) -> None:
        kind = getattr(piece, "kind", ANSWER)
        if kind == COMMENTARY:
            return  # a harmony tool call as written: for the tool-call parser, not the reader
        if kind == REASONING:
            if self.show:
                if not self.thinking:
                    write(self._dim("Thinking...") + "\n")
                    self.thinking = True
                write(self._dim(piece))
            return
        self.end()
        write(piece)

    def end(self) -> None:
        """Close a reasoning part that is still open (the answer starts, or the reply ends)."""
        if self.thinking:
            write("\n" + self._dim("...done thinking.") + "\n\n")
            self.thinking = False


def end_text() -> None:
    """Finish streamed text with a newline on a terminal (pipes get the text exactly)."""
    if stdout_is_tty():
        sys.stdout.write("\n")
        sys.stdout.flush()


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def stats_line(stats: Any) -> str:
    return (
        f"prompt: {stats.prompt_tokens} tokens ({stats.prompt_processed} processed) "
        f"in {stats.prompt_seconds:.2f} s, {stats.prompt_tps:.1f} tokens/s | "
        f"generation: {stats.completion_tokens} tokens in {stats.generation_seconds:.2f} s, "
        f"{stats.generation_tps:.1f} tokens/s"
    ) + (
        f" | draft: {stats.accepted}/{stats.drafted} accepted ({100 * stats.acceptance:.0f}%)"
        if stats.drafted
        else ""
    )


def print_stats(stats: Any) -> None:
    info(stats_line(stats))


def print_prompt(text: str) -> None:
    """The rendered prompt, on stderr, before generation."""
    if _stderr.is_terminal:
        _stderr.rule("prompt", style="dim")
        _stderr.print(text, markup=False, style="dim")
        _stderr.rule(style="dim")
    else:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on a terminal's stderr while something slow happens; nothing in a pipe."""
    if _stderr.is_terminal:
        with _stderr.status(message, spinner="dots"):
            yield
    else:
        yield


# ---- downloads, model tables and model details (llmrun pull / list / show / rm) ----------


def size(n: float) -> str:
    """Bytes as the Hub shows them: 1234567 -> '1.2 MB'."""
    return decimal(int(n))


def count(n: int) -> str:
    """A parameter count: 292800 -> '293K', 1_235_814_400 -> '1.24B', 999_950 -> '1M'."""
    value, units = float(n), ["K", "M", "B", "T"]
    unit = ""
    # The next unit up once three digits round to 1000 (999_950 was '1e+03K').
    while units and float(f"{value:.3g}") >= 1000:
        value, unit = value / 1000, units.pop(0)
    return f"{value:.3g}{unit}"


def ago(timestamp: float | None) -> str:
    if timestamp is None:
        return "never"
    seconds = max(0.0, time.time() - timestamp)
    for unit, span in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= span:
            n = int(seconds // span)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


class _LiveDownloads:
    """Download progress on a terminal: a bar per file and one in total, with bytes/s and ETA."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._tasks: dict[str, TaskID] = {}
        self._done: dict[str, int] = {}
        self._total: TaskID | None = None

    def on_notice(self, message: str) -> None:
        self._progress.console.print(message, style="dim", markup=False)

    def on_start(self, files: list[Any], total_bytes: int) -> None:
        already = sum(f.done for f in files)
        if len(files) > 1:
            self._total = self._progress.add_task("total", total=total_bytes, completed=already)
        for f in files:
            self._tasks[f.name] = self._progress.add_task(f.name, total=f.size, completed=f.done)
            self._done[f.name] = f.done

    def on_progress(self, name: str, done: int, total: int) -> None:
        self._progress.update(self._tasks[name], completed=done)
        if self._total is not None:
            self._progress.advance(self._total, done - self._done[name])
        self._done[name] = done

    def on_file_done(self, name: str) -> None:
        self._progress.update(self._tasks[name], completed=self._done[name])


class _QuietDownloads:
    """Download progress in a pipe: one line when it starts and one per finished file."""

    def on_notice(self, message: str) -> None:
        info(message)

    def on_start(self, files: list[Any], total_bytes: int) -> None:
        already = sum(f.done for f in files)
        resumed = f", resuming with {size(already)} already here" if already else ""
        info(f"downloading {len(files)} file(s), {size(total_bytes)}{resumed}")

    def on_progress(self, name: str, done: int, total: int) -> None:
        pass

    def on_file_done(self, name: str) -> None:
        info(f"downloaded {name}")


@contextlib.contextmanager
def download_progress() -> Iterator[Any]:
    """A progress reporter for hub.pull: live bars on a terminal, a few plain lines in a pipe."""
    if not _stderr.is_terminal:
        yield _QuietDownloads()
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=_stderr) as progress:
        yield _LiveDownloads(progress)


def print_models(models: list[Any]) -> None:
    """The `llmrun list` table on stdout (plain, aligned columns in a pipe)."""
    header = ("NAME", "FORMAT", "QUANT", "PARAMS", "SIZE", "LAST USED", "CACHE")
    rows = [
        (
            m.name,
            m.format,
            m.quant or "-",
            count(m.parameters) if m.parameters else "-",
            size(m.size),
            ago(m.last_used),
            m.source,
        )
        for m in models
    ]
    if stdout_is_tty():
        table = Table(box=None, header_style="bold", pad_edge=False)
        for title in header:
            # A name is what `run` takes: folded onto a second line where the terminal is
            # narrow, never cut short with an ellipsis.
            overflow = "fold" if title == "NAME" else "ellipsis"
            justify = "right" if title in ("PARAMS", "SIZE") else "left"
            table.add_column(title, justify=justify, overflow=overflow)
        for row in rows:
            table.add_row(*row)
        Console(highlight=False).print(table)
        return
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        sys.stdout.write(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n"
        )


def print_model_info(info: dict[str, Any]) -> None:
    """The `llmrun show` details on stdout."""
    weights = ", ".join(
        f"{kind} ({t['tensors']} tensor{'s' * (t['tensors'] != 1)}, {size(t['bytes'])})"
        for kind, t in info["tensor_types"].items()
    )
    per_weight = info["bytes_per_weight"]
    if per_weight:
        weights += f"; {per_weight:.3g} bytes per weight"
    params, active = info["parameters"], info.get("active_parameters")
    params_line = f"{count(params)} ({params:,})" if params else "-"
    least = info.get("active_parameters_least")
    if active and least:  # GroveMoE's: as many adjugate experts run as groups are chosen
        params_line += f", {count(least)}-{count(active)} active a token ({least:,}-{active:,})"
    elif active:
        params_line += f", {count(active)} active a token ({active:,})"
    not_run = info.get("not_run")
    if not_run:  # a speech recogniser's parts llmrun does not load
        params_line += f"; {count(not_run['parameters'])} more in {not_run['what']}, not run"
    lines = [
        ("name", info["name"]),
        ("format", info["format"]),
        ("architecture", _architecture_line(info)),
        ("parameters", params_line),
        ("context length", str(info["context_length"] or "-")),
        ("weights", weights or "-"),
        ("tokenizer", _tokenizer_line(info)),
        ("KV cache", _kv_line(info.get("kv_cache_bytes_8k"), info.get("embedding_model"))),
        *([("pooling", info["pooling"])] if info.get("pooling") else []),
        ("chat template", "yes (--template prints it)" if info["chat_template"] else "no"),
        ("license", info["license"] or "-"),
        ("path", info["path"]),
    ]
    lines += [
        ("files" if i == 0 else "", f"{f['name']}  {size(f['size'])}")
        for i, f in enumerate(info["files"])
    ]
    for key, value in lines:
        sys.stdout.write(f"{key:<15}{value}\n")


def _architecture_line(info: dict[str, Any]) -> str:
    architecture = info["architecture"] or "-"
    if info.get("speech_recognition"):
        return f"{architecture} ({info['speech_recognition']})"
    if info.get("text_to_text"):
        return f"{architecture} ({info['text_to_text']})"
    if info.get("reranker"):
        return f"{architecture} (reranker)"
    return f"{architecture} (embedding model)" if info.get("embedding_model") else architecture


def _kv_line(at_8k: int | None, encoder: bool = False) -> str:
    if at_8k is None:
        return "-"
    if at_8k == 0 and encoder:  # BERT's: a whole text in one forward
        return "none (an encoder)"
    if at_8k == 0:  # Mamba's: its state per sequence is all it keeps
        return "none (no attention layers)"
    return f"{size(at_8k)} at 8k context ({size(at_8k / 8192)} a token, f32)"


def _tokenizer_line(info: dict[str, Any]) -> str:
    pre = info.get("pre_tokenizer")
    return (info["tokenizer"] or "-") + (f", pre-tokenizer {pre}" if pre else "")


# ---- llmrun bench -----------------------------------------------------------------------


@contextlib.contextmanager
def bench_progress(total_runs: int) -> Iterator[Any]:
    """A reporter for bench.benchmark, called as (what is running, runs finished): a live
    bar on a terminal's stderr, nothing in a pipe."""
    if not _stderr.is_terminal:
        yield lambda description, done: None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=_stderr, transient=True) as progress:
        task = progress.add_task("bench", total=total_runs)
        yield lambda description, done: progress.update(task, description=description, advance=done)


# ---- llmrun run --batch -------------------------------------------------------------------


@contextlib.contextmanager
def batch_progress(total: int, verbose: bool, results_on_terminal: bool) -> Iterator[Any]:
    """A reporter for batch_run, called as (lines done, tokens made): a bar with done/total,
    tokens/s and the time left on a terminal's stderr; in a pipe nothing, or with
    `verbose` a plain line at most each second. `verbose` ends with a summary line. Where
    the result lines go to the terminal too, there is no bar: redrawing it would
    overwrite them."""
    start = time.perf_counter()
    counts = {"done": 0, "tokens": 0, "said": 0.0}

    def rate() -> float:
        elapsed = time.perf_counter() - start
        return counts["tokens"] / elapsed if elapsed > 0 else 0.0

    def plain(done: int, tokens: int) -> None:
        counts["done"] += done
        counts["tokens"] += tokens
        now = time.perf_counter()
        if verbose and now - counts["said"] >= 1.0:
            counts["said"] = now
            info(f"{counts['done']}/{total} done, {rate():.1f} tokens/s")

    if not _stderr.is_terminal or results_on_terminal:
        yield plain
    else:
        columns = (
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:.1f} tokens/s"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=_stderr, transient=True) as progress:
            task = progress.add_task("batch", total=total, rate=0.0)

            def bar(done: int, tokens: int) -> None:
                counts["done"] += done
                counts["tokens"] += tokens
                progress.update(task, advance=done, rate=rate())

            yield bar
    if verbose:
        elapsed = time.perf_counter() - start
        info(
            f"{counts['done']} prompts, {counts['tokens']} tokens generated in "
            f"{elapsed:.2f} s, {rate():.1f} tokens/s"
        )


_BENCH_TEXT_COLUMNS = ("model", "quant", "device", "dtype", "test", "draft")
# Facts about a loaded model rather than a test: on a terminal, a table of their own.
_BENCH_MODEL_COLUMNS = (
    "quant",
    "size",
    "params",
    "weights/token",
    "device",
    "dtype",
    "peak mem",
    "load s",
)


def _bench_columns(records: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(title, record -> cell) for the human tables; batch and roofline columns only
    when the batch size varies or the roofline was measured."""

    def fixed(key: str, digits: int) -> Any:
        return lambda r: "-" if r[key] is None else f"{r[key]:.{digits}f}"

    columns = [
        ("model", lambda r: r["model"]),
        ("quant", lambda r: r["quant"]),
        ("size", lambda r: size(r["model_bytes"])),
        ("params", lambda r: count(r["n_params"])),
        ("weights/token", lambda r: size(r["weight_bytes_per_token"])),
        ("device", lambda r: r["device"]),
        ("dtype", lambda r: r["dtype"]),
        ("threads", lambda r: str(r["threads"])),
    ]
    if len({r["n_batch"] for r in records}) > 1:
        columns.append(("batch", lambda r: str(r["n_batch"])))
    columns += [
        ("test", lambda r: r["test"]),
        ("t/s", lambda r: f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"),
        ("TTFT ms", fixed("ttft_ms", 1)),
        ("GB/s", fixed("gbps", 2)),
    ]
    if any("draft" in r for r in records):
        columns += [
            ("draft", lambda r: f"{r['draft']} (max {r['draft_max']})"),
            ("accepted", lambda r: "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"),
        ]
    if any(r["roofline_gbps"] is not None for r in records):
        columns += [("max GB/s", fixed("roofline_gbps", 1)), ("% of max", fixed("roofline_pct", 1))]
    columns += [
        ("peak mem", lambda r: size(r["peak_memory_bytes"])),
        ("load s", fixed("load_s", 2)),
    ]
    return columns


def _rich_table(columns: list[tuple[str, Any]], records: list[dict[str, Any]], **kwargs) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False, collapse_padding=True, **kwargs)
    for title, _ in columns:
        justify = "left" if title in _BENCH_TEXT_COLUMNS else "right"
        table.add_column(title, justify=justify, no_wrap=title in ("test", "t/s"))
    for record in records:
        table.add_row(*(cell(record) for _, cell in columns))
    return table


def _bench_footer(records: list[dict[str, Any]]) -> str:
    first = records[0]
    runs = first["repetitions"]
    accelerators = sorted({r["device_name"] for r in records if r["device"] != "cpu"})
    sources = ", ".join(sorted({r["memory_source"] for r in records}))
    return (
        f"llmrun {first['llmrun_version']}, torch {first['torch_version']}, "
        f"cpu: {first['cpu']}"
        f"{f', kernels: {kernels}' if (kernels := first['cpu_kernels']) else ''}"
        f"{''.join(f', {name}' for name in accelerators)}. "
        f"t/s: mean ± sd of {runs} run{'s' * (runs != 1)} after a warm-up; "
        f"GB/s: weights/token x tg t/s; peak mem: {sources}"
    )


def _csv_cell(value: Any) -> Any:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "" if value is None else value


def print_bench(records: list[dict[str, Any]], output: str | None = None) -> None:
    """Bench results on stdout: `output` json, jsonl, csv or md, or by default a Rich
    table on a terminal and markdown in a pipe."""
    if output == "json":
        sys.stdout.write(json.dumps(records, indent=2, ensure_ascii=False) + "\n")
    elif output == "jsonl":
        for record in records:
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif output == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(records[0]), lineterminator="\n")
        writer.writeheader()
        for record in records:
            writer.writerow({k: _csv_cell(v) for k, v in record.items()})
    elif output is None and stdout_is_tty():
        # One row per model (its last record: peak memory only grows), then one per test,
        # so that neither table is wider than a terminal.
        columns = _bench_columns(records)
        models = {(r["model_path"], r["device"], r["dtype"]): r for r in records}
        model_columns = [c for c in columns if c[0] == "model" or c[0] in _BENCH_MODEL_COLUMNS]
        test_columns = [c for c in columns if c[0] not in _BENCH_MODEL_COLUMNS]
        console = Console(highlight=False)
        console.print(_rich_table(model_columns, list(models.values())))
        console.print()
        console.print(_rich_table(test_columns, records))
        console.print(_bench_footer(records), style="dim")
    else:
        columns = _bench_columns(records)
        lines = ["| " + " | ".join(title for title, _ in columns) + " |"]
        lines.append(
            "| "
            + " | ".join("---" if t in _BENCH_TEXT_COLUMNS else "---:" for t, _ in columns)
            + " |"
        )
        lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in records]
        sys.stdout.write("\n".join(lines) + "\n\n" + _bench_footer(records) + "\n")
    sys.stdout.flush()
