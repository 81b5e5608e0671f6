"""Structured outputs: decoding that follows a grammar, through llguidance.

A Grammar is a JSON schema, a Lark grammar (llguidance's dialect, which embeds JSON schemas
with `%json`) or a GBNF grammar (llama.cpp's, which gbnf.py writes as Lark that matches
what llama.cpp matches), compiled once for a model's vocabulary and cached; each
sequence that follows it gets its own Constraint, which masks the logits before every draw
(every token the grammar forbids goes to -inf) and moves on with the token drawn. The
Sampler applies it (SamplingParams.grammar), so `run`, `chat` and every slot of the
batching scheduler decode under their own masks.

Why llguidance: a Rust core in one small wheel (3 MB, MIT) with no dependencies, where
xgrammar's wheel requires torch, transformers and triton; it builds its tokenizer from a
raw byte vocabulary (what GGUF vocabularies are), computes a mask for a 150k vocabulary in
tens of microseconds without a precomputation per schema, names what it cannot compile,
and reads JSON schemas and Lark. It is optional for the core install (its wheels need
glibc 2.31, torch's 2.28): the `serve` extra has it, and a constraint without it is one
clear error.

The vocabulary is llmrun's own Tokenizer: each id's exact bytes (special tokens marked, so
the grammar can name them as `<[id]>`), its end-of-generation ids as the grammar's end,
and for text the grammar forces, the longest tokens that spell it.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from llmrun import gbnf, gbnf_lexemes
from llmrun.errors import UsageError
from llmrun.tool_calls import JSON_STYLE  # how JSON is written under a schema

ANY_OBJECT = {"type": "object"}
CACHED_GRAMMARS = 64
JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")


class GrammarError(UsageError):
    """A grammar or schema the engine cannot use."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise UsageError(
            "structured output needs the llguidance package: pip install llguidance "
            "(the serve extra has it: pip install 'llmrun[serve]')"
        ) from None
    return llguidance


class Vocabulary:
    """A model's vocabulary as llguidance sees it, and the grammars compiled for it."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]) -> None:
        llg = _llguidance()
        self.tokenizer = tokenizer
        self.size = tokenizer.vocab_size
        special = tokenizer.special_ids
        pieces = []
        for i in range(self.size):
            raw = tokenizer.token_bytes(i)
            # llguidance's convention: a special token's bytes begin with 0xff.
            pieces.append(b"\xff" + raw if i in special else raw)
        self._index = {}
        for i, raw in enumerate(pieces):
            if i not in special and raw:
                self._index.setdefault(raw, i)
        self._longest = max((len(raw) for raw in self._index), default=1)
        eos = [i for i in eos_ids if 0 <= i < self.size] or [tokenizer.eos_id or 0]
        self.eos_ids = eos
        source = _Source(self, pieces, eos[0], tokenizer.bos_id, sorted(special))
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(source), eos_token=eos)
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def tokenize(self, data: bytes | str) -> list[int]:
        """Token ids for text the grammar forces: the longest token first, no BOS and no
        SentencePiece leading space (and no tokenizer state, so any thread may ask)."""
        data = data.encode() if isinstance(data, str) else data
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._index.get(data[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                raise GrammarError(f"no token of the vocabulary spells byte {data[i]:#04x}")
        return out

    def token(self, text: str) -> str:
        """How a grammar names `text`: a special token as `<[id]>`, anything else quoted."""
        token = self.tokenizer.token_id(text)
        if token is not None and token in self.tokenizer.special_ids:
            return f"<[{token}]>"
        return json.dumps(text)

    def compile(self, grammar: str, what: str) -> Grammar:
        """The grammar (llguidance's serialized form) compiled, from the cache if it was."""
        with self._lock:
            found = self._grammars.get(grammar)
            if found is not None:
                self._grammars.move_to_end(grammar)
                return found
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(grammar, self.lltok)
        if error:
            raise GrammarError(f"{what}: the grammar engine (llguidance) cannot use it: {error}")
        compiled = Grammar(self, llg.LLMatcher(self.lltok, grammar, log_level=0), what, grammar)
        with self._lock:
            self._grammars[grammar] = compiled
            while len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return compiled

    def json_schema(
        self, schema: dict[str, Any] | bool | None, what: str = "the schema"
    ) -> Grammar:
        """A grammar for JSON that matches `schema` (None: any JSON object)."""
        body = _schema_object(schema, what)
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(body), defaults=JSON_STYLE)
        except ValueError as e:
            raise GrammarError(f"{what}: {e}") from None
        return self.compile(grammar, what)

    def after_reasoning(self, grammar: Grammar, close_id: int) -> Grammar:
        """`grammar` after the reasoning that a prompt left open: any tokens but the
        reasoning's end and the end-of-generation ones, then the end (`close_id`), then
        what `grammar` matches. Applied from the first token, a grammar would have the
        model write its answer inside the reasoning (llama.cpp's grammars for a prompt
        that opens `<think>` start the same way)."""
        barred = ",".join(str(i) for i in sorted({close_id, *self.eos_ids}))
        return self._after(f"<[^{barred}]>* <[{close_id}]>", grammar)

    def in_answer_message(self, grammar: Grammar, markers: Any) -> Grammar:
        """`grammar` as Muse Glimmer's answer (`markers`, a reasoning.Harmony of its tokens),
        for a prompt that ends with `<|start|>assistant`: after any messages of reasoning
        (` to=self<|message|>`, any tokens but the message's end, then `<|eom|><|start|>
        assistant`), in its message to the user (` to=user<|message|>`), as llama.cpp's
        grammar for a response format has it (common/parsers/muse-glimmer.cpp)."""
        barred = ",".join(str(i) for i in sorted({markers.end, *self.eos_ids}))
        message, end, start = (f"<[{i}]>" for i in (markers.message, markers.end, markers.start))
        reasoning = f'(" to=self" {message} <[^{barred}]>* {end} {start} "assistant")*'
        return self._after(f'{reasoning} " to=user"? {message}', grammar)

    def _after(self, before: str, grammar: Grammar) -> Grammar:
        """`grammar` after what the Lark expression `before` matches."""
        source = grammar.source
        inner = (
            json.loads(source)["grammars"]
            if source.lstrip().startswith("{")
            else [{"lark_grammar": source}]
        )
        outer = {"lark_grammar": f"start: {before} @reply\n"}
        combined = {"grammars": [outer, {**inner[0], "name": "reply"}, *inner[1:]]}
        return self.compile(json.dumps(combined), grammar.what)

    def lark(self, text: str, what: str = "the grammar") -> Grammar:
        return self.compile(_llguidance().LLMatcher.grammar_from_lark(text), what)

    def gbnf(self, text: str, what: str = "the grammar") -> Grammar:
        """A GBNF grammar, read as llama.cpp reads it (gbnf.py), or llguidance's Lark when
        it starts with `%llguidance`, as llama.cpp takes one."""
        if text.lstrip().startswith("%llguidance"):
            return self.lark(text, what)
        try:
            rules = gbnf.parse(text, self.tokenizer.token_id, self.size)
            lark = gbnf.lark(rules, gbnf_lexemes.terminals(rules))
        except gbnf.GbnfError as e:
            raise GrammarError(f"{what}: {e}") from None
        except RecursionError:  # read and written by recursion, as llama.cpp does
            raise GrammarError(f"{what}: groups nest too deeply (hundreds of levels)") from None
        return self.lark(lark, what)


class _Source:
    # What llguidance's TokenizerWrapper reads: tokens as bytes, ids, a tokenize function.
    def __init__(self, vocab: Vocabulary, tokens: list[bytes], eos: int, bos: int | None, special):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, bos
        self.special_token_ids = special
        self._vocab = weakref.ref(vocab)

    def __call__(self, data: bytes | str) -> list[int]:
        vocab = self._vocab()
        return vocab.tokenize(data) if vocab is not None else []


_VOCABULARIES: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


def vocabulary(tokenizer: Any, eos_ids: Sequence[int]) -> Vocabulary:
    """The Vocabulary of a tokenizer (built once: about a second for 150k tokens)."""
    with _VOCAB_LOCK:
        found = _VOCABULARIES.get(tokenizer)
        if found is None:
            found = _VOCABULARIES[tokenizer] = Vocabulary(tokenizer, eos_ids)
        return found


class Grammar:
    """A compiled grammar; `constraint()` starts one sequence that follows it. `source`
    is the grammar as llguidance read it (Lark, or its JSON form)."""

    def __init__(self, vocab: Vocabulary, matcher: Any, what: str, source: str) -> None:
        self.vocab, self._matcher, self.what, self.source = vocab, matcher, what, source

    def constraint(self) -> Constraint:
        return Constraint(self, self._matcher.deep_copy())


class Constraint:
    """One sequence's place in a grammar: masks logits, then takes the token drawn.

    The mask for the next token is computed on a worker thread as soon as a token is
    taken (llguidance lets go of the GIL), so it overlaps the model's forward pass that
    comes between; `apply` waits for it.
    """

    def __init__(self, grammar: Grammar, matcher: Any) -> None:
        self.grammar, self.matcher = grammar, matcher
        self.size = grammar.vocab.size
        self.bits = np.zeros((1, (self.size + 31) // 32), dtype=np.int32)
        self._pending: Future | None = _workers().submit(self._fill)  # overlaps the prefill

    def _fill(self) -> None:
        _llguidance().numpy.fill_next_token_bitmask(self.matcher, self.bits)

    def compute(self) -> None:
        """Have the mask for the next token in `bits` (waiting for the worker's)."""
        pending = self._pending
        if pending is _DONE:
            return
        if pending is None:
            self._fill()
        else:
            pending.result()
        self._pending = _DONE

    def allowed(self) -> np.ndarray:
        """Whether each token id may come next, as a bool array of the vocabulary's size."""
        self.compute()
        if self.matcher.is_error():
            raise GrammarError(f"{self.grammar.what}: {self.matcher.get_error()}")
        bits = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.size]
        return bits.view(np.bool_)

    def apply(self, logits: Any) -> Any:
        """A copy of `logits` (a torch tensor [V]) with every forbidden token at -inf."""
        import torch

        allowed = self.allowed()
        n = min(self.size, logits.shape[-1])
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            raw = logits.numpy()
            out = np.full(raw.shape, -np.inf, dtype=np.float32)  # ids past the tokenizer's too
            np.copyto(out[:n], raw[:n], where=allowed[:n])
            return torch.from_numpy(out)
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[:n] = torch.from_numpy(allowed[:n].copy())
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        if self._pending not in (None, _DONE):
            self._pending.result()  # a mask still being computed reads the matcher
        self._pending = None
        if self.matcher.is_stopped() and not self.matcher.is_error():
            return  # complete: what follows (ends of text, with ignore_eos) is not its business
        if not self.matcher.consume_token(token):
            raise GrammarError(f"{self.grammar.what}: {self.matcher.get_error()}")
        if not self.matcher.is_stopped():
            self._pending = _workers().submit(self._fill)

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and only an end of text may follow."""
        return self.matcher.is_stopped()


_DONE = object()  # `_pending` when `bits` holds the next token's mask
_WORKERS: list[ThreadPoolExecutor] = []


def _workers() -> ThreadPoolExecutor:
    if not _WORKERS:
        with _VOCAB_LOCK:
            if not _WORKERS:
                count = min(4, os.cpu_count() or 1)
                _WORKERS.append(ThreadPoolExecutor(count, thread_name_prefix="llmrun-grammar"))
    return _WORKERS[0]


# --- JSON schemas ---------------------------------------------------------------------


def json_lark(schema: dict[str, Any] | None, what: str = "the schema") -> str:
    """A Lark rule body (`%json {...}`) for JSON that matches `schema` (None: any object)."""
    body = dict(_schema_object(schema, what))
    body["x-guidance"] = {**JSON_STYLE, **(body.get("x-guidance") or {})}
    return "%json " + json.dumps(body, ensure_ascii=False)


def _schema_object(schema: dict[str, Any] | bool | None, what: str) -> dict[str, Any]:
    """`schema`, checked, as the object llguidance reads: None is any JSON object, and the
    boolean schemas (which llguidance refuses at the top) true any JSON value."""
    if schema is None:
        return ANY_OBJECT
    problem = check_schema(schema)
    if problem:
        raise GrammarError(f"{what} is not a JSON schema: {problem}")
    if schema is False:
        raise GrammarError(f"{what} is false, a schema that no JSON value matches")
    return {} if schema is True else closed_objects(schema)


# Keywords beside which an object's other properties may be described elsewhere.
_COMBINATIONS = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")


def closed_objects(schema: Any, in_combination: bool = False) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that lists its
    properties and says nothing of others, as llama.cpp's converter (and vLLM's xgrammar
    in its default strict mode) read it: a model under a schema writes only the
    properties the schema names. An object combined with other schemas keeps its
    default, since closing it would refuse what the others allow (`in_combination`: a
    branch of allOf, or of anyOf/oneOf beside properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            combined = key == "allOf" or (key != "prefixItems" and "properties" in schema)
            out[key] = [closed_objects(sub, combined) for sub in schema[key]]
    for key in (*_SCHEMA_ONE, "items"):
        if key in schema:
            value = schema[key]
            out[key] = (
                [closed_objects(sub) for sub in value]
                if isinstance(value, list)
                else closed_objects(value)
            )
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not in_combination
        and not any(key in schema for key in _COMBINATIONS)
    ):
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains")


def check_schema(schema: Any, where: str = "") -> str | None:
    """What makes `schema` not a JSON schema (a wrong type for a keyword), or None."""
    at = f" at {where}" if where else ""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a schema must be an object or a boolean{at}, not {type(schema).__name__}"
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        bad = [k for k in kinds if k not in JSON_TYPES]
        if bad or not kinds:
            return f"unknown type {bad[0] if bad else kind!r}{at} (types: {', '.join(JSON_TYPES)})"
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{key}{at} must be an object of schemas"
            for name, sub in schema[key].items():
                problem = check_schema(sub, f"{where}/{key}/{name}".lstrip("/"))
                if problem:
                    return problem
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                return f"{key}{at} must be a list of schemas"
            for i, sub in enumerate(schema[key]):
                problem = check_schema(sub, f"{where}/{key}/{i}".lstrip("/"))
                if problem:
                    return problem
    for key in _SCHEMA_ONE:
        if key in schema:
            problem = check_schema(schema[key], f"{where}/{key}".lstrip("/"))
            if problem:
                return problem
    if "items" in schema:
        # One schema for every item, or (drafts 4 to 2019-09) a list, one per position.
        items = schema["items"]
        subs = dict(enumerate(items)) if isinstance(items, list) else {None: items}
        for i, sub in subs.items():
            path = "items" if i is None else f"items/{i}"
            problem = check_schema(sub, f"{where}/{path}".lstrip("/"))
            if problem:
                return problem
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        return f"required{at} must be a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"enum{at} must be a list"
    return None


def for_prompt(
    grammar: Grammar | None, markers: Any, prompt: str, answer: bool = True
) -> Grammar | None:
    """`grammar` for a reply to `prompt`: where the prompt leaves the model's reasoning
    open (it ends with `<think>`, as DeepSeek-R1's and GLM-4.7's templates write it), the
    grammar after that reasoning (Vocabulary.after_reasoning); for Muse Glimmer's messages,
    an `answer`'s grammar in its message to the user (Vocabulary.in_answer_message), where
    the prompt leaves the reply's header open (calls' grammars spell their own messages)."""
    from llmrun.reasoning import Harmony, Markers

    if grammar is None:
        return None
    if isinstance(markers, Harmony) and markers.channel is None:
        if answer and prompt.endswith("<|start|>assistant"):
            return grammar.vocab.in_answer_message(grammar, markers)
        return grammar
    if not isinstance(markers, Markers) or not markers.opened_by(prompt):
        return grammar
    return grammar.vocab.after_reasoning(grammar, markers.close_id)


# --- `run --format` and `--grammar` -------------------------------------------------


def for_cli(engine: Any, output_format: str | None, grammar_file: str | None) -> Grammar | None:
    """The grammar of `run --format` or `--grammar` (None for neither)."""
    if output_format is None and grammar_file is None:
        return None
    if output_format is not None and grammar_file is not None:
        raise UsageError("give either --format or --grammar, not both")
    vocab = vocabulary(engine.tokenizer, engine.eos_ids)
    if output_format is not None:
        return for_format(vocab, output_format)
    return for_grammar_file(vocab, grammar_file)


def for_format(vocab: Vocabulary, value: str) -> Grammar:
    """`--format json` (any JSON object) or `--format FILE` (a JSON schema), as ollama's."""
    if value == "json":
        return vocab.json_schema(None, "--format json")
    path = Path(value).expanduser()
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(
            f"--format {value}: {e.strerror or e} (give json, or a JSON schema file)"
        ) from None
    except ValueError as e:
        raise UsageError(f"--format {value}: not JSON ({e})") from None
    return vocab.json_schema(schema, f"--format {value}")


def for_grammar_file(vocab: Vocabulary, value: str) -> Grammar:
    """`--grammar FILE`: a GBNF grammar, as llama.cpp's --grammar-file takes."""
    try:
        text = Path(value).expanduser().read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--grammar {value}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--grammar {value}: not UTF-8 text") from None
    return vocab.gbnf(text, f"--grammar {value}")
