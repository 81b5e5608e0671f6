"""GBNF grammars (llama.cpp's) read with llama.cpp's meaning and written as llguidance Lark.

GBNF has no lexer: llama.cpp matches a grammar one character at a time, so a rule like
`x ::= [a-z]*` followed by `"b"` matches "ab". llguidance lexes greedily instead: a
terminal takes the longest text it can, so turning a GBNF rule into one terminal (as
llguidance's own gbnf_to_lark does with every rule that is a regular expression) refuses
"ab" there, and a literal "ab" as one terminal swallows the "b" that `("a" | "ab") "bc"`
needs. Here each character class, `.` and character of a literal becomes a terminal of
exactly one character, which greedy lexing cannot stretch; sequences, alternatives,
repetitions and rules are left to llguidance's Earley parser, as llama.cpp's stacks do.
The one exception, for speed, is a repetition that gbnf_lexemes.py shows may be one
greedy terminal without losing any text the grammar matches.

The syntax is llama.cpp's (grammars/README.md): rules `name ::= ...` ending at a newline
outside parentheses, names of letters, digits, `-` (and `_`), literals `"..."`, classes
`[...]` and `[^...]`, `.`, groups, `*` `+` `?` `{m}` `{m,}` `{m,n}`, `#` comments,
escapes `\\x..` `\\u....` `\\U........` `\\t` `\\r` `\\n` `\\\\` `\\"` `\\[` `\\]` `\\-`,
and tokens `<[id]>`, `<text>` (a single token of the vocabulary) and `!` before either
(any one token but that). Left recursion, which llama.cpp refuses, is accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_CHAR = 0x10FFFF
NEST_LIMIT = 8  # parentheses in a row in the Lark written, deeper groups made rules
SURROGATES = (0xD800, 0xDFFF)  # not characters: no UTF-8 text holds them
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


class GbnfError(ValueError):
    """A grammar that is not GBNF, said with its line and column."""


# Nodes compare by identity: gbnf_lexemes tells each occurrence apart, equal or not.


@dataclass(frozen=True, eq=False)
class Chars:
    """One character: from `ranges` (inclusive), or outside them when `negated`."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False


@dataclass(frozen=True, eq=False)
class Token:
    """One token of the vocabulary by id, or any other token when `negated`."""

    id: int
    negated: bool = False


@dataclass(frozen=True, eq=False)
class Ref:
    """A use of the rule `name`."""

    name: str


@dataclass(frozen=True, eq=False)
class Repeat:
    """`item` at least `least` times in a row and at most `most`."""

    item: Item
    least: int
    most: int | None  # None: no limit


@dataclass(frozen=True, eq=False)
class Alternatives:
    """One of `options`, each a sequence of items (a group, or a rule's body)."""

    options: tuple[tuple[Item, ...], ...]


Item = Chars | Token | Ref | Repeat | Alternatives


Rules = dict[str, Alternatives]  # by name, in the order defined


def parse(text: str, token_id: Callable[[str], int | None], vocab_size: int) -> Rules:
    """The rules of GBNF `text`; `token_id` names the token a `<text>` stands for (None:
    the vocabulary has no such single token)."""
    return _Parser(text, token_id, vocab_size).rules()


class _Parser:
    """GBNF text to rules, each an Alternatives, keyed by name in the order defined."""

    def __init__(self, text: str, token_id: Callable[[str], int | None], vocab_size: int) -> None:
        self.text, self.pos, self.token_id, self.vocab_size = text, 0, token_id, vocab_size
        self.used: dict[str, int] = {}  # rule name -> where it is first used

    def rules(self) -> Rules:
        rules: Rules = {}
        self.space(newlines=True)
        while self.pos < len(self.text):
            start = self.pos
            name = self.name()
            if name in rules:
                raise self.error(f"rule {name} is defined twice", start)
            self.space(newlines=False)
            if not self.text.startswith("::=", self.pos):
                raise self.error(f"expected ::= after the rule name {name}")
            self.pos += 3
            self.space(newlines=True)
            rules[name] = self.alternatives(nested=False)
            if self.peek() and self.peek() not in "\r\n":
                raise self.error(f"unexpected {self.peek()!r} in rule {name}")
            self.space(newlines=True)
        for name, where in self.used.items():
            if name not in rules:
                raise self.error(f"rule {name} is used but not defined", where)
        if "root" not in rules:
            raise GbnfError("no rule named root (where a GBNF grammar starts)")
        if "root" not in _productive(rules):
            # llguidance would only say so mid-generation, in a dump of its parser's state.
            raise GbnfError("root matches no text: every way through it recurs without end")
        return rules

    # --- reading ---

    def peek(self, ahead: int = 0) -> str:
        i = self.pos + ahead
        return self.text[i] if i < len(self.text) else ""

    def error(self, message: str, at: int | None = None) -> GbnfError:
        at = self.pos if at is None else at
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return GbnfError(f"line {line}, column {column}: {message}")

    def space(self, newlines: bool) -> None:
        while (c := self.peek()) and (c in " \t#" or (newlines and c in "\r\n")):
            if c == "#":
                while self.peek() and self.peek() not in "\r\n":
                    self.pos += 1
            else:
                self.pos += 1

    def name(self) -> str:
        start = self.pos
        while (c := self.peek()) and _is_name_char(c):
            self.pos += 1
        if self.pos == start:
            raise self.error("expected a rule name")
        return self.text[start : self.pos]

    def integer(self) -> int:
        start = self.pos
        while self.peek().isascii() and self.peek().isdigit():
            self.pos += 1
        if self.pos == start:
            raise self.error("expected a number")
        return int(self.text[start : self.pos])

    def char(self) -> int:
        """One character of a literal or class, escapes read, as a code point."""
        start, c = self.pos, self.peek()
        if not c:
            raise self.error("unexpected end of the grammar")
        self.pos += 1
        if c != "\\":
            return ord(c)
        e = self.peek()
        self.pos += 1
        if e in _ESCAPES:
            return ord(_ESCAPES[e])
        if e not in _HEX_DIGITS:
            raise self.error(f"unknown escape \\{e}", start)
        digits = self.text[self.pos : self.pos + _HEX_DIGITS[e]]
        if len(digits) != _HEX_DIGITS[e] or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"\\{e} needs {_HEX_DIGITS[e]} hex digits", start)
        self.pos += len(digits)
        code = int(digits, 16)
        if code > MAX_CHAR:
            raise self.error(f"\\{e}{digits} is past the last Unicode character", start)
        return code

    # --- the grammar's structure ---

    def alternatives(self, nested: bool) -> Alternatives:
        options = [self.sequence(nested)]
        while self.peek() == "|":
            self.pos += 1
            self.space(newlines=True)
            options.append(self.sequence(nested))
        return Alternatives(tuple(options))

    def sequence(self, nested: bool) -> tuple[Item, ...]:
        items: list[Item] = []
        while c := self.peek():
            start = self.pos
            if c == '"':
                items.append(self.literal())
            elif c == "[":
                items.append(self.char_class())
            elif c in "<!":
                items.append(self.token())
            elif _is_name_char(c):
                name = self.name()
                self.used.setdefault(name, start)
                items.append(Ref(name))
            elif c == "(":
                self.pos += 1
                self.space(newlines=True)
                items.append(self.alternatives(nested=True))
                if self.peek() != ")":
                    raise self.error("no ) closes this group", start)
                self.pos += 1
            elif c == ".":
                self.pos += 1
                items.append(Chars((), negated=True))  # any character, newlines too
            elif c in "*+?{":
                if not items:
                    raise self.error(f"{c} follows nothing to repeat")
                items.append(self.repeat(items.pop(), nested))
            else:
                break
            self.space(newlines=nested)
        return tuple(items)

    def literal(self) -> Item:
        """A literal as one item (a repetition after it repeats all of it), a Chars for
        each of its characters."""
        self.pos += 1
        chars: list[Item] = []
        while self.peek() != '"':
            at, code = self.pos, self.char()
            if SURROGATES[0] <= code <= SURROGATES[1]:
                raise self.error(f"U+{code:04X} is a surrogate, not a character", at)
            chars.append(Chars(((code, code),)))
        self.pos += 1
        return chars[0] if len(chars) == 1 else Alternatives((tuple(chars),))

    def char_class(self) -> Chars:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            low = high = self.char()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                high = self.char()
                if high < low:
                    raise self.error(f"the range {chr(low)}-{chr(high)} is reversed", start)
            ranges += _without_surrogates(low, high)
        self.pos += 1
        if _every_character(ranges) if negated else not ranges:
            raise self.error("this character class matches no character", start)
        return Chars(tuple(ranges), negated)

    def token(self) -> Token:
        start = self.pos
        negated = self.peek() == "!"
        self.pos += negated
        end = self.text.find(">", self.pos)
        if self.peek() != "<" or end < 0:
            raise self.error("expected a token: <[id]> or <text>", start)
        written, self.pos = self.text[self.pos : end + 1], end + 1
        number = written[2:-2]
        if (
            written.startswith("<[")
            and written.endswith("]>")
            and number.isascii()
            and number.isdigit()
        ):
            token = int(number)
        else:
            found = self.token_id(written)  # llama.cpp: what tokenizes to one token
            if found is None:
                raise self.error(f"{written} is not one token of the vocabulary", start)
            token = found
        if token >= self.vocab_size:
            raise self.error(
                f"token {token} is past the vocabulary ({self.vocab_size} tokens)", start
            )
        return Token(token, negated)

    def repeat(self, item: Item, nested: bool) -> Repeat:
        c, start = self.peek(), self.pos
        self.pos += 1
        if c != "{":
            return Repeat(item, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
        self.space(newlines=nested)
        least = most = self.integer()
        self.space(newlines=nested)
        if self.peek() == ",":
            self.pos += 1
            self.space(newlines=nested)
            most = self.integer() if self.peek().isdigit() else None
            self.space(newlines=nested)
        if self.peek() != "}":
            raise self.error("expected } to close the repetition", start)
        self.pos += 1
        if most is not None and most < least:
            raise self.error(f"{{{least},{most}}} repeats at most fewer than at least", start)
        return Repeat(item, least, most)


def _is_name_char(c: str) -> bool:
    # llama.cpp's letters, digits and "-"; "_" too, which no llama.cpp grammar has bare.
    return c.isascii() and (c.isalnum() or c in "-_")


def _every_character(ranges: list[tuple[int, int]]) -> bool:
    """Whether the ranges (surrogates left out) hold every character."""
    at = 0
    for low, high in sorted(ranges):
        if low > at:
            return False
        at = max(at, high + 1)
        if at == SURROGATES[0]:
            at = SURROGATES[1] + 1
    return at > MAX_CHAR


def refs(item: Item) -> set[str]:
    """The names of the rules `item` uses itself (not those they use)."""
    if isinstance(item, Ref):
        return {item.name}
    if isinstance(item, Repeat):
        return refs(item.item)
    if isinstance(item, Alternatives):
        return set().union(*(refs(x) for seq in item.options for x in seq))
    return set()


def users(rules: Rules) -> dict[str, set[str]]:
    """For each rule, the rules that use it."""
    found: dict[str, set[str]] = {name: set() for name in rules}
    for name, body in rules.items():
        for used in refs(body):
            found[used].add(name)
    return found


def _productive(rules: Rules) -> set[str]:
    """The rules that match some (finite) text."""
    found: set[str] = set()
    todo, used_by = list(rules), users(rules)
    while todo:  # a rule is looked at again when one it uses is found productive
        name = todo.pop()
        if name not in found and _matches_some(rules[name], found):
            found.add(name)
            todo += used_by[name]
    return found


def _matches_some(item: Item, productive: set[str]) -> bool:
    if isinstance(item, Ref):
        return item.name in productive
    if isinstance(item, Repeat):
        return item.least == 0 or item.most == 0 or _matches_some(item.item, productive)
    if isinstance(item, Alternatives):
        return any(all(_matches_some(x, productive) for x in seq) for seq in item.options)
    return True  # a character class that matches nothing is refused as it is read


def _without_surrogates(low: int, high: int) -> list[tuple[int, int]]:
    """The range less the surrogates, which no text holds (and Lark's regexes refuse)."""
    parts = [(low, min(high, SURROGATES[0] - 1)), (max(low, SURROGATES[1] + 1), high)]
    return [(a, b) for a, b in parts if a <= b]


# --- writing Lark ---


def lark(rules: Rules, terminals: frozenset[Repeat] = frozenset()) -> str:
    """The llguidance Lark grammar for `rules`: each repetition in `terminals` (which
    gbnf_lexemes.terminals finds safe) as one regex terminal, everything else down to
    one-character terminals."""
    return _Writer(rules, terminals).grammar()


class _Writer:
    def __init__(self, rules: Rules, terminals: frozenset[Repeat]) -> None:
        self.rules, self.terminals = rules, terminals
        # Names Lark reads as rules (lower case) and that no two GBNF names share.
        self.names = {
            name: f"g{i}_{name.lower().replace('-', '_')}" for i, name in enumerate(rules)
        }
        self.groups: list[str] = []  # rules h0, h1... for groups nested too deep

    def grammar(self) -> str:
        lines = ["%llguidance {}", f"start: {self.names['root']}"]
        lines += [
            f"{self.names[name]}: {self.options(body, 0)}" for name, body in self.rules.items()
        ]
        return "\n".join(lines + self.groups) + "\n"

    def options(self, alts: Alternatives, depth: int) -> str:
        return " | ".join(
            " ".join(self.item(i, depth) for i in seq) or '""' for seq in alts.options
        )

    def item(self, item: Item, depth: int) -> str:
        """`item` in Lark, as an operand a postfix `*` may follow; `depth`: how many
        parentheses it sits in."""
        if isinstance(item, Chars):
            return f"/{_char_class(item)}/"
        if isinstance(item, Token):
            return f"<[{'^' if item.negated else ''}{item.id}]>"
        if isinstance(item, Ref):
            return self.names[item.name]
        if isinstance(item, Alternatives):
            if len(item.options) == 1 and len(item.options[0]) == 1:
                return self.item(item.options[0][0], depth)
            return self.group(lambda inner: self.options(item, inner), depth)
        if item.most == 0:
            return '""'
        if item in self.terminals:
            # A terminal matches some text: the repetition's empty match is the `?`.
            once = f"/{self.regex(Repeat(item.item, max(item.least, 1), item.most))}/"
            return once if item.least else self.group(lambda _: once + "?", depth)
        return self.group(
            lambda inner: _repeat(self.item(item.item, inner), item.least, item.most), depth
        )

    def group(self, write: Callable[[int], str], depth: int) -> str:
        """What `write` writes, in parentheses, or past NEST_LIMIT of them a rule of its
        own: llguidance's Lark reader refuses groups nested about 30 deep."""
        if depth < NEST_LIMIT:
            return f"({write(depth + 1)})"
        index = len(self.groups)
        self.groups.append("")  # its place, kept while the groups inside it are written
        self.groups[index] = f"h{index}: {write(0)}"
        return f"h{index}"

    def regex(self, item: Item) -> str:
        """`item` as one regular expression (Rust regex syntax, as llguidance reads it)."""
        if isinstance(item, Chars):
            return _char_class(item)
        if isinstance(item, Ref):
            return self.regex(self.rules[item.name])
        if isinstance(item, Alternatives):
            seqs = ("".join(self.regex(i) for i in seq) for seq in item.options)
            return f"(?:{'|'.join(seqs)})"
        if isinstance(item, Repeat):
            if item.most == 0:
                return ""
            return _repeat(f"(?:{self.regex(item.item)})", item.least, item.most)
        raise ValueError("a token is no part of a regular expression")


def _char_class(chars: Chars) -> str:
    if chars.negated and not chars.ranges:
        return "(?s:.)"  # `.`, which matches newlines in GBNF
    ranges = "".join(f"\\x{{{a:X}}}" + (f"-\\x{{{b:X}}}" if b > a else "") for a, b in chars.ranges)
    return f"[{'^' if chars.negated else ''}{ranges}]"


def _repeat(inner: str, least: int, most: int | None) -> str:
    """`inner` repeated, in the notation Lark and regexes share."""
    if most is None and least <= 1:
        return inner + ("*" if least == 0 else "+")
    if (least, most) == (0, 1):
        return inner + "?"
    return inner + f"{{{least},{'' if most is None else most}}}"
