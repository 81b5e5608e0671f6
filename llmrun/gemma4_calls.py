"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, read and written.

Gemma 4's chat template writes a call's arguments in Gemma's own notation, not JSON
(format_argument in its template): strings between `<|"|>` tokens, keys bare (or, in
other places, quoted the same way), numbers and true/false as they are, lists in
brackets, mappings in braces. A model writes its calls so; this reads them into JSON
values, as llama.cpp's Gemma 4 parser (common/chat-peg-parser.cpp) reads them, and
writes values back and spells the grammar that forces a call (llguidance's Lark). No
torch here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_CALL = re.compile(re.escape(OPEN) + r"\s*call:([^{\s]+)\s*(?=\{)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_WORDS = {"true": True, "false": False, "null": None, "None": None}
_BARE_KEY = re.compile(r"[^:}\s][^:}]*")


def parse_call(region: str) -> tuple[str, str]:
    """A region `<|tool_call>call:NAME{...}<tool_call|>` as its name and its arguments as
    JSON text; ValueError where it is not one well-formed call."""
    found = _CALL.match(region)
    if found is None:
        raise ValueError("not a Gemma 4 call")
    arguments, end = _value(region, found.end())
    if not isinstance(arguments, dict) or region[end:].strip() != CLOSE:
        raise ValueError("a Gemma 4 call's arguments are one mapping, then its end")
    return found.group(1), json.dumps(arguments, ensure_ascii=False)


def _value(text: str, i: int) -> tuple[Any, int]:
    """The value at text[i:] (after white space) and where it ends."""
    i = _skip(text, i)
    if text.startswith(QUOTE, i):
        end = text.index(QUOTE, i + len(QUOTE))
        return text[i + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", i):
        return _members(text, i + 1)
    if text.startswith("[", i):
        items: list[Any] = []
        i = _skip(text, i + 1)
        if text.startswith("]", i):
            return items, i + 1
        while True:
            item, i = _value(text, i)
            items.append(item)
            i = _skip(text, i)
            if text.startswith("]", i):
                return items, i + 1
            i = _expect(text, i, ",")
    number = _NUMBER.match(text, i)
    if number:
        literal = number.group()
        return (float(literal) if any(c in literal for c in ".eE") else int(literal)), number.end()
    for word, value in _WORDS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    raise ValueError(f"no Gemma value at {text[i : i + 20]!r}")


def _members(text: str, i: int) -> tuple[dict[str, Any], int]:
    """A mapping's members after its `{`, to its `}`."""
    members: dict[str, Any] = {}
    i = _skip(text, i)
    if text.startswith("}", i):
        return members, i + 1
    while True:
        i = _skip(text, i)
        if text.startswith(QUOTE, i):
            end = text.index(QUOTE, i + len(QUOTE))
            key, i = text[i + len(QUOTE) : end], end + len(QUOTE)
        else:
            bare = _BARE_KEY.match(text, i)
            if bare is None:
                raise ValueError("a Gemma mapping's key is missing")
            key, i = bare.group().strip(), bare.end()
        members[key], i = _value(text, _expect(text, _skip(text, i), ":"))
        i = _skip(text, i)
        if text.startswith("}", i):
            return members, i + 1
        i = _expect(text, i, ",")


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _expect(text: str, i: int, mark: str) -> int:
    if not text.startswith(mark, i):
        raise ValueError(f"expected {mark!r} at {text[i : i + 20]!r}")
    return i + len(mark)


def write_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as Gemma 4's template writes it (keys bare and sorted)."""
    return f"{OPEN}call:{name}{write_value(dict(arguments))}{CLOSE}"


def write_value(value: Any) -> str:
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{write_value(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(write_value(v) for v in value) + "]"
    return json.dumps(value)


def grammar(
    functions: Sequence[Mapping[str, Any]], token: Callable[[str], str], parallel: bool
) -> str:
    """A Lark grammar (llguidance's) for calls of `functions` (OpenAI function objects): the
    name one of theirs, the arguments the members their parameters list (any where they
    list none), each value of its schema's type and enum (_Values). Which members a call
    holds is not checked, nor a string's pattern or a number's range. `token(text)` spells
    a marker token."""
    values = _Values(token(QUOTE))
    names = " | ".join(
        f"{json.dumps(f['name'])} {values.mapping(f.get('parameters') or {})}" for f in functions
    )
    call = f'call: {token(OPEN)} "call:" ({names}) {token(CLOSE)}'
    return "\n".join([f"start: call{'+' if parallel else ''}", call, *values.rules, ""])


class _Values:
    """Lark rules for Gemma values of JSON schemas, named as they are made."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self.rules = [
            f'value: {quote} TEXT {quote} | mapping | list | NUMBER | "true" | "false" | "null"',
            'mapping: "{" (KEY ":" value ("," KEY ":" value)*)? "}"',
            'list: "[" (value ("," value)*)? "]"',
            "KEY: /[A-Za-z_][A-Za-z0-9_]*/",
            "TEXT: /[^<]*/",  # up to the closing <|"|>
            f"NUMBER: /{_NUMBER.pattern}/",
            "INTEGER: /-?(0|[1-9][0-9]*)/",
        ]

    def rule(self, body: str) -> str:
        name = f"v{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def mapping(self, schema: Mapping[str, Any]) -> str:
        """A mapping of the schema's properties, each at most once, in the sorted order the
        template writes them, those it requires always."""
        properties = schema.get("properties") or {}
        if not properties:
            return '"{" "}"' if schema.get("additionalProperties") is False else "mapping"
        keys = sorted(properties)
        required = set(schema.get("required") or ()) & set(keys)
        pairs = [f"{json.dumps(key + ':')} {self.of(properties[key])}" for key in keys]
        # members[i]: a non-empty run of members from keys[i:], the required ones in it
        members: list[str] = [""] * len(keys)
        for i in reversed(range(len(keys))):
            rest = members[i + 1] if i + 1 < len(keys) else None
            needs_rest = bool(required & set(keys[i + 1 :]))
            options = [
                pairs[i] + (f' "," {rest}' if needs_rest else f' ("," {rest})?' if rest else "")
            ]
            if keys[i] not in required and rest:
                options.append(rest)
            members[i] = self.rule(" | ".join(options))
        inside = members[0] if required else f"{members[0]}?"
        return self.rule(f'"{{" {inside} "}}"')

    def of(self, schema: Any) -> str:
        """An expression for a value of `schema`."""
        if not isinstance(schema, Mapping):
            return "value"
        if "enum" in schema or "const" in schema:
            options = schema.get("enum", [schema.get("const")])
            return "(" + " | ".join(self.literal(v) for v in options) + ")"
        kinds = schema.get("type")
        if isinstance(kinds, list):
            return "(" + " | ".join(self.of({**schema, "type": k}) for k in kinds) + ")"
        if "anyOf" in schema or "oneOf" in schema:
            options = schema.get("anyOf") or schema.get("oneOf")
            return "(" + " | ".join(self.of(o) for o in options) + ")"
        if kinds == "string":
            return f"{self.quote} TEXT {self.quote}"
        if kinds in ("number", "integer"):
            return "NUMBER" if kinds == "number" else "INTEGER"
        if kinds == "boolean":
            return '("true" | "false")'
        if kinds == "null":
            return '"null"'
        if kinds == "object":
            return self.mapping(schema)
        if kinds == "array" and isinstance(schema.get("items"), Mapping):
            item = self.of(schema["items"])
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        return "value"

    def literal(self, value: Any) -> str:
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}"
        return json.dumps(write_value(value))
