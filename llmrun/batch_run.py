"""`run --batch`: many prompts in one process, decoded together by serve's scheduler.

The input is JSON Lines (one request per line: `prompt` or `messages`, an optional `id`,
per-line sampling fields) or plain text, one prompt per line. Every line is read,
checked and tokenized before anything is generated, so a bad line is reported with its
number (and skipped, or stops the run under `strict`) and the totals are known. Each
request becomes what `llmrun run` would feed the model for it (the chat template around
a prompt, the whole conversation for `messages`), so greedy and seeded results equal
the same prompts run one by one. Results are JSON lines, in input order or as they
finish, each written whole and flushed while Ctrl-C is held back (it stops the run
between lines), so an output file never ends in half a line; ids already in it are
skipped on `resume`.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from llmrun.api import Engine
from llmrun.batching import Request, Scheduler
from llmrun.chat import PLAIN_STOP
from llmrun.chat_template import plain_transcript
from llmrun.errors import LlmrunError, UsageError
from llmrun.generate import Response, check_fits
from llmrun.reasoning import ANSWER, Splitter
from llmrun.sampling import SamplingParams

SAMPLING_FIELDS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "seed": int}
FIELDS = ("id", "prompt", "messages", *SAMPLING_FIELDS, "max_tokens", "stop", "format")
# What `run --json` prints that says nothing about the reply itself (and would change
# between two runs of the same batch).
DROPPED = ("model", "timings")
# How every result line begins (record_of puts the id first).
RESULT_START = b'{"id": '
POLL_SECONDS = 0.1  # how often the main thread looks for a Ctrl-C while it waits


class BadLine(LlmrunError):
    """An input line that cannot be run: its number and what is wrong with it."""

    def __init__(self, number: int, message: str) -> None:
        super().__init__(f"line {number}: {message}")
        self.number = number


@dataclass
class Options:
    """What the command line sets for every line (a line's own fields win)."""

    params: SamplingParams
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    raw: bool = False
    switches: dict[str, Any] = field(default_factory=dict)  # template variables


@dataclass
class Line:
    """One checked input line, not yet tied to a model."""

    number: int
    id: str | int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    has_max_tokens: bool = False
    stop: list[str] | None = None
    format: str | dict[str, Any] | None = None

    @property
    def key(self) -> str:
        return id_key(self.id)


@dataclass
class Item:
    """A line ready for the scheduler: its request and how to read the reply."""

    line: Line
    request: Request
    prompt_text: str
    plain_reply: bool  # a reply to a plain "Assistant:" transcript (starts with a space)


def id_key(value: Any) -> str:
    """Ids compare as their JSON text, so 1 and "1" are different ids."""
    return json.dumps(value, ensure_ascii=False)


# --- reading the input -------------------------------------------------------------------


def read_lines(data: bytes, plain: bool) -> Iterator[Line | BadLine]:
    """Each non-blank line of `data`, checked: a Line, or a BadLine saying what is wrong.
    Plain-text lines are prompts with their line number as id."""
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as e:
            yield BadLine(number, f"not UTF-8 text ({e.reason} at byte {e.start})")
            continue
        if not text.strip():
            continue
        try:
            line = Line(number, number, prompt=text) if plain else parse_line(number, text)
            if line.key in seen:
                raise BadLine(number, f"the id {line.key} is already on line {seen[line.key]}")
        except BadLine as e:
            yield e
            continue
        seen[line.key] = number
        yield line


def parse_line(number: int, text: str) -> Line:
    """One JSON Lines request, checked field by field (raises BadLine)."""

    def bad(message: str) -> BadLine:
        return BadLine(number, message)

    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise bad("must be a JSON object with a prompt or messages")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise bad(f"unknown field {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    line = Line(number, obj.get("id", number))
    if isinstance(line.id, bool) or not isinstance(line.id, str | int):
        raise bad("id must be a string or an integer")
    if ("prompt" in obj) == ("messages" in obj):
        raise bad("give either prompt or messages")
    if "prompt" in obj:
        line.prompt = obj["prompt"]
        if not isinstance(line.prompt, str) or not line.prompt.strip():
            raise bad("prompt must be a non-empty string")
    else:
        line.messages = _messages(obj["messages"], bad)
    for name, kind in SAMPLING_FIELDS.items():
        value = obj.get(name)
        if value is None:
            continue
        if not _is_number(value, kind):
            raise bad(f"{name} must be {'an integer' if kind is int else 'a number'}")
        line.sampling[name] = value
    try:
        SamplingParams().updated(**line.sampling)
    except UsageError as e:
        raise bad(str(e)) from None
    if "max_tokens" in obj:
        value = obj["max_tokens"]
        if value is not None and (not _is_number(value, int) or value < -1):
            raise bad("max_tokens must be an integer >= -1 (-1: until end of text)")
        line.has_max_tokens = True
        line.max_tokens = None if value in (None, -1) else value
    stop = obj.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop must be a string or a list of strings")
        line.stop = stops
    line.format = obj.get("format")
    if line.format is not None and line.format != "json" and not isinstance(line.format, dict):
        raise bad('format must be "json" or a JSON schema (an object)')
    return line


def _is_number(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, int | float)


def _messages(value: Any, bad: Callable[[str], BadLine]) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role")
        content = message.get("content")
        blocks = isinstance(content, list) and all(
            isinstance(b, dict) and isinstance(b.get("text", ""), str) for b in content
        )
        if content is not None and not isinstance(content, str) and not blocks:
            raise bad(f"messages[{i}].content must be a string or a list of text blocks")
    return value


# --- lines to requests -------------------------------------------------------------------


def prepare(engine: Engine, line: Line, options: Options, grammar: Any = None) -> Item:
    """The request `llmrun run` would make of the line: the same prompt text, sampling,
    limit and stop strings (raises LlmrunError for one it cannot make)."""
    stop = list(options.stop if line.stop is None else line.stop)
    plain_reply = False
    if line.messages is not None:
        if options.raw:
            raise UsageError("messages need the chat template: drop --raw")
        if engine.template is None:
            # What chat and serve do for a model without a template.
            text, plain_reply = plain_transcript(line.messages), True
            stop.append(PLAIN_STOP)
        else:
            text = engine.render(line.messages, **options.switches)
    else:
        text = engine.prompt_text(line.prompt, raw=options.raw, **options.switches)
    ids = engine.tokenizer.encode(text)
    if not ids:
        raise LlmrunError("the prompt is empty")
    check_fits(len(ids), engine.ctx_size)
    params = options.params.updated(**line.sampling)
    if line.format is not None:
        grammar = _grammar(engine, line.format)
    if grammar is not None:
        from llmrun.structured import for_prompt

        params = replace(params, grammar=for_prompt(grammar, engine.markers, text))
    max_tokens = line.max_tokens if line.has_max_tokens else options.max_tokens
    return Item(line, Request(ids, params, max_tokens, stop), text, plain_reply)


def _grammar(engine: Engine, value: str | dict[str, Any]) -> Any:
    from llmrun import structured

    vocab = structured.vocabulary(engine.tokenizer, engine.eos_ids)
    return vocab.json_schema(None if value == "json" else value, "format")


# --- the output file -----------------------------------------------------------------------


def done_ids(path: Path) -> set[str]:
    """The ids (as id_key) of the results already in `path`; a torn last line (a crash
    mid-write elsewhere) is cut off, so the run appends after whole lines only."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise UsageError(f"--resume {path}: {e.strerror or e}") from None
    whole = data.rfind(b"\n") + 1
    ids = set()
    lines = data[:whole].splitlines()
    for number, raw in enumerate(lines, start=1):
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "id" not in record:
            raise LlmrunError(
                f"--resume {path}: line {number} is not a result line of llmrun run --batch"
            )
        ids.add(id_key(record["id"]))
    if whole < len(data):
        # Only a file of result lines, torn in a result line (perhaps before its id
        # was whole), loses its torn end.
        torn = data[whole:]
        if not (torn.startswith(RESULT_START) or RESULT_START.startswith(torn)):
            raise LlmrunError(
                f"--resume {path}: line {len(lines) + 1} is not a result line of llmrun run --batch"
            )
        with open(path, "r+b") as f:
            f.truncate(whole)
    return ids


class LineWriter:
    """Writes each JSON line whole and flushed to a binary stream (an unbuffered file,
    or stdout's buffer), so nothing waits in a buffer when the process dies."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def write(self, record: dict[str, Any]) -> None:
        view = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        while view:  # an unbuffered file may take a long line in parts
            written = self.stream.write(view)
            view = view[len(view) if written is None else written :]
        self.stream.flush()


@contextlib.contextmanager
def _held_interrupts() -> Iterator[threading.Event]:
    """Ctrl-C only sets the event while the batch runs (the loop stops between lines,
    never inside a write); off the main thread signals cannot be caught, nor arrive."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


# --- running ---------------------------------------------------------------------------------


@dataclass
class _Reply:
    item: Item
    split: Splitter


def record_of(engine: Engine, item: Item, split: Splitter, final: Response) -> dict[str, Any]:
    """A result line: the id, then what `run --json` prints, less its model and timings."""
    record = engine.result_record(split, final, None)
    return {"id": item.line.id, **{k: v for k, v in record.items() if k not in DROPPED}}


def run(
    engine: Engine,
    items: Sequence[Item],
    writer: LineWriter,
    parallel: int = 4,
    ordered: bool = True,
    on_failure: Callable[[BadLine], None] = lambda e: None,
    strict: bool = False,
    on_progress: Callable[[int, int], None] = lambda done, tokens: None,
) -> int:
    """Generate every item through one scheduler and write its result line (in input
    order, or as each finishes). A request that fails is passed to `on_failure` and
    skipped, or under `strict` raised. Returns how many failed; raises
    KeyboardInterrupt after Ctrl-C, with every line written whole."""
    scheduler = Scheduler(engine, parallel, queue=parallel)
    events: queue.Queue[tuple[int, Any]] = queue.Queue()
    replies: dict[int, _Reply] = {}  # in flight
    # Done, by index: the record still to write in order, or None (failed, or written).
    finished: dict[int, dict[str, Any] | None] = {}
    # In flight at most: the slots and a queue as long, so the scheduler never refuses one.
    window = 2 * parallel
    submitted = head = failures = 0  # head: the first index not yet done and written

    def fail(index: int, error: Exception) -> None:
        nonlocal failures
        line = items[index].line
        bad = error if isinstance(error, BadLine) else BadLine(line.number, str(error))
        if strict:
            raise bad
        failures += 1
        on_failure(bad)
        finished[index] = None
        on_progress(1, 0)

    scheduler.start()
    with _held_interrupts() as interrupted:
        try:
            while head < len(items):
                while submitted < len(items) and len(replies) < window:
                    index, item = submitted, items[submitted]
                    submitted += 1
                    split = Splitter(engine.markers, item.prompt_text)
                    replies[index] = _Reply(item, split)
                    try:
                        scheduler.submit(item.request, lambda e, i=index: events.put((i, e)))
                    except LlmrunError as e:
                        del replies[index]
                        fail(index, e)
                while head < submitted and head in finished:
                    record = finished.pop(head)
                    if record is not None:
                        writer.write(record)
                    head += 1
                if interrupted.is_set():
                    raise KeyboardInterrupt
                if head == len(items):
                    break
                try:
                    index, event = events.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
                reply = replies[index]
                if isinstance(event, Exception):
                    del replies[index]
                    fail(index, event)
                    continue
                text = event.text
                if reply.item.plain_reply and not reply.split.text[ANSWER]:
                    text = text.lstrip()  # the reply to "Assistant:" starts with a space
                reply.split.feed(event.token, text)
                if event.finish_reason is None:
                    continue
                del replies[index]
                record = record_of(engine, reply.item, reply.split, event)
                if not ordered:
                    writer.write(record)
                finished[index] = record if ordered else None
                on_progress(1, event.stats.completion_tokens)
        finally:
            scheduler.close()
    return failures


def run_file(
    engine: Engine,
    data: bytes,
    options: Options,
    output: Path | None = None,
    *,
    plain: bool = False,
    resume: bool = False,
    parallel: int = 4,
    ordered: bool = True,
    strict: bool = False,
    grammar: Any = None,
    on_failure: Callable[[BadLine], None] = lambda e: None,
    progress: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
) -> int:
    """The whole of `run --batch`: read and check `data`'s lines, leave out the ids
    `output` already holds (with `resume`), prepare the rest (each bad line reported
    through `on_failure`, or raised under `strict` before anything runs), then run them
    into `output` (None: stdout). `progress(total)` gives a context whose value is
    called as (lines done, tokens made). Returns how many lines were skipped as bad."""
    if parallel < 1:
        raise UsageError(f"--parallel must be positive, got {parallel}")
    done = done_ids(output) if resume and output is not None else set()
    items: list[Item] = []
    failures = 0
    for line in read_lines(data, plain):
        try:
            if isinstance(line, BadLine):
                raise line
            if line.key in done:
                continue
            try:
                items.append(prepare(engine, line, options, grammar))
            except LlmrunError as e:
                raise BadLine(line.number, str(e)) from None
        except BadLine as e:
            if strict:
                raise
            failures += 1
            on_failure(e)
    if output is None:
        stream = sys.stdout.buffer
    else:
        try:
            stream = open(output, "ab" if resume else "wb", buffering=0)  # noqa: SIM115
        except OSError as e:
            raise UsageError(f"-o {output}: {e.strerror or e}") from None
    with contextlib.ExitStack() as stack:
        if output is not None:
            stack.enter_context(stream)
        on_progress = stack.enter_context(progress(len(items))) if progress else None
        failures += run(
            engine,
            items,
            LineWriter(stream),
            parallel,
            ordered,
            on_failure,
            strict,
            on_progress or (lambda done, tokens: None),
        )
    return failures
