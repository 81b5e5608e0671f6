"""Which repetitions of a GBNF grammar may be llguidance terminals (gbnf.py's speed-up).

One-character terminals keep GBNF's meaning under llguidance's greedy lexer, but its
Earley parser then runs at every character: over a 128k-token vocabulary a mask inside
free text costs milliseconds instead of a tenth of one. A repetition of a regular
expression (`[0-9]+`, the body of a JSON string) can be one terminal, matched greedily,
where that cannot lose a parse:

1. no character that may follow it could extend it, so its longest match ends where the
   grammar ends it; and
2. no other terminal the parser may expect where it starts begins with a character it
   begins with, so the lexer never drops a shorter match of another terminal for it.

Both are read off Glushkov-style first, last and follow sets of the grammar's terminals
(over-approximated for rules: a rule's last terminals are followed by whatever follows
any of its uses), and which terminals may be expected, or matched, together (see
_Together). Every approximation errs toward keeping one-character terminals, which is
slower, never wrong; a grammar too large to analyse within WORK_LIMIT keeps them all.
Checked against the one-character writing of the same grammar in
tests/test_structured.py (test_repetitions_made_terminals_lose_no_text).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable

from llmrun.gbnf import MAX_CHAR, Alternatives, Chars, Item, Ref, Repeat, Rules, Token, refs, users

# Nodes of a repetition with its rules written out, as one regex (small: gbnf.lark
# recurses through them).
REGEX_LIMIT = 200
WORK_LIMIT = 2_000_000  # steps of the analysis (about a second) before it gives up
END = "end of the grammar"  # follows the root's last terminals

CharSet = tuple[tuple[int, int], ...]  # disjoint ranges of code points, ascending
Summary = tuple[bool, frozenset, frozenset]  # nullable, first terminals, last terminals


def terminals(rules: Rules) -> frozenset[Repeat]:
    """The repetitions of `rules` that gbnf.lark may write as one terminal each."""
    plain = _Sets(rules, frozenset())
    sizes = _regular_sizes(rules)

    def qualifies(node: Repeat) -> bool:
        return (
            node.most != 0
            and not plain.of(node.item)[0]  # a terminal matches some text
            and _size(node.item, sizes) <= REGEX_LIMIT
        )

    candidates: set[Repeat] = set()
    for body in rules.values():
        candidates |= _outermost(body, qualifies)
    chars: dict[object, CharSet] = {}  # every terminal's first characters
    work = [WORK_LIMIT]  # what is left of it, spent by _Together
    while candidates:
        graph = _Sets(rules, frozenset(candidates))
        follow = graph.follows(rules.values())
        nullable, start, last = graph.of_rule["root"]
        for leaf in last:
            follow[leaf].add(END)
        for t in candidates:
            chars[t] = _union(_chars(leaf) for leaf in plain.of(t)[1])
        lead = _Lead(chars)
        together = _Together(start | ({END} if nullable else set()), follow, lead, work)
        crowded = together.crowded()
        alone = {t: _ends_alone(t, follow[t], lead, plain, rules, work) for t in candidates}
        if together.gave_up or None in alone.values():
            return frozenset()  # a grammar too large to tell: one character at a time
        unsafe = {t for t in candidates if t in crowded or not alone[t]}
        if not unsafe:
            break
        candidates -= unsafe
        for t in unsafe:
            candidates |= _outermost(t.item, qualifies)
    return frozenset(candidates)


class _Sets:
    """Nullable, first and last terminals of every node; `opaque` repetitions count as
    terminals (their insides unseen)."""

    def __init__(self, rules: Rules, opaque: frozenset[Repeat]) -> None:
        self.rules, self.opaque = rules, opaque
        self.of_rule: dict[str, Summary] = {n: (False, frozenset(), frozenset()) for n in rules}
        self.memo: dict[Item, Summary] = {}
        # Rules use each other: grow their summaries to a fixed point, a rule looked at
        # again when one it uses has grown.
        todo, used_by = list(rules), users(rules)
        while todo:
            name = todo.pop()
            self.memo = {}
            found = self.of(rules[name])
            if found != self.of_rule[name]:
                self.of_rule[name] = found
                todo += used_by[name]
        self.memo = {}

    def of(self, node: Item) -> Summary:
        if node in self.memo:
            return self.memo[node]
        if isinstance(node, (Chars, Token)):
            summary: Summary = (False, frozenset({node}), frozenset({node}))
        elif node in self.opaque:  # a terminal, optional when it may repeat no times
            summary = (node.least == 0, frozenset({node}), frozenset({node}))
        elif isinstance(node, Ref):
            summary = self.of_rule[node.name]
        elif isinstance(node, Repeat):
            nullable, first, last = self.of(node.item)
            if node.most == 0:
                summary = (True, frozenset(), frozenset())
            else:
                summary = (nullable or node.least == 0, first, last)
        else:
            seqs = [self.of_sequence(seq) for seq in node.options]
            summary = (
                any(s[0] for s in seqs),
                frozenset().union(*(s[1] for s in seqs)),
                frozenset().union(*(s[2] for s in seqs)),
            )
        self.memo[node] = summary
        return summary

    def of_sequence(self, seq: tuple[Item, ...]) -> Summary:
        parts = [self.of(x) for x in seq]
        first: set = set()
        for nullable, f, _ in parts:
            first |= f
            if not nullable:
                break
        last: set = set()
        for nullable, _, lst in reversed(parts):
            last |= lst
            if not nullable:
                break
        return all(p[0] for p in parts), frozenset(first), frozenset(last)

    def follows(self, nodes: Iterable[Item]) -> defaultdict[object, set]:
        """Which terminals may come right after each terminal, inside `nodes` (rules
        referred to are not entered: pass their bodies too)."""
        follow: defaultdict[object, set] = defaultdict(set)

        def walk(node: Item) -> None:
            if isinstance(node, Repeat) and node not in self.opaque and node.most != 0:
                walk(node.item)
                if node.most is None or node.most > 1:
                    _, first, last = self.of(node.item)
                    for leaf in last:
                        follow[leaf] |= first
            elif isinstance(node, Alternatives):
                for seq in node.options:
                    for i, x in enumerate(seq):
                        walk(x)
                        for y in seq[i + 1 :]:
                            nullable, first, _ = self.of(y)
                            for leaf in self.of(x)[2]:
                                follow[leaf] |= first
                            if not nullable:
                                break

        for node in nodes:
            walk(node)
        return follow


class _Lead:
    """The characters a terminal may begin with (none for a token or the end), found once."""

    def __init__(self, known: dict[object, CharSet]) -> None:
        self.known = known  # repetitions made terminals, filled in by the caller

    def __call__(self, leaf: object) -> CharSet:
        if leaf not in self.known:
            self.known[leaf] = _chars(leaf)
        return self.known[leaf]


def _ends_alone(
    t: Repeat, after: set, lead: _Lead, plain: _Sets, rules: Rules, work: list[int]
) -> bool | None:
    """Condition 1: nothing that may follow `t` begins with a character that could
    extend a complete match of it: one that may come after any character of `t` that may
    have matched together with one it can end on. (None: out of work.)"""
    if any(isinstance(leaf, Token) for leaf in after):
        return False
    inside = [t, *(rules[name] for name in _rules_used(t, rules))]
    follow = plain.follows(inside)
    _, first, last = plain.of(t)
    together = _Together(first, follow, lead, work)
    if together.gave_up:
        return None
    extend = _union(_chars(leaf) for end in last for p in together.with_(end) for leaf in follow[p])
    return not _intersects(extend, _union(lead(leaf) for leaf in after))


class _Together:
    """Which terminals the parser may expect together ("companions"), and which may match
    the same text, from the terminals at the start and what follows each.

    Companions grow to a fixed point: those at the start are companions; after a terminal
    x matches, the parser expects what follows x or any companion of x that could have
    matched the same text (shares a first character), so all of that is companion to each
    terminal that follows x. Sets are bitmasks over the terminals. `gave_up`: the work
    left (`work[0]`, spent here) ran out first.
    """

    def __init__(
        self, start: set, follow: defaultdict[object, set], lead: _Lead, work: list[int]
    ) -> None:
        leaves = list({*start, *follow, *(y for ys in follow.values() for y in ys)} - {END})
        bit = {leaf: 1 << i for i, leaf in enumerate(leaves)}

        def mask(items: Iterable[object]) -> int:
            return sum(bit[x] for x in set(items) if x != END)

        after = {x: mask(follow[x]) for x in leaves}
        self.leaves, self.bit, self.overlap = leaves, bit, _overlaps(leaves, bit, lead)
        self.companions = dict.fromkeys(leaves, 0)
        for x in start - {END}:
            self.companions[x] = mask(start)
        self.matched = dict.fromkeys(leaves, 0)  # what may match with x, so far
        expected = dict.fromkeys(leaves, 0)  # and what the parser then expects
        self.gave_up = False
        todo = list(leaves)
        while todo:
            x = todo.pop()
            new = (bit[x] | (self.companions[x] & self.overlap[x])) & ~self.matched[x]
            self.matched[x] |= new
            work[0] -= 1 + new.bit_count()
            if work[0] < 0:
                self.gave_up = True
                return
            for z in _members(new, leaves):
                expected[x] |= after[z]
            for y in follow[x] - {END}:
                if expected[x] & ~self.companions[y]:
                    self.companions[y] |= expected[x]
                    todo.append(y)

    def with_(self, leaf: object) -> Iterable[object]:
        """The terminals that may match the same text as `leaf` (it too)."""
        return _members(self.matched.get(leaf, 0), self.leaves)

    def crowded(self) -> set:
        """The repetitions that condition 2 rules out: ones the parser may expect together
        with another (or a token) that begins with a character they begin with."""
        return {
            x
            for x in self.leaves
            if isinstance(x, Repeat) and self.companions[x] & self.overlap[x] & ~self.bit[x]
        }


def _overlaps(leaves: list, bit: dict[object, int], lead: _Lead) -> dict[object, int]:
    """For each terminal, the terminals that share a first character with it (a token
    with every one): code points cut into pieces at every range's ends."""
    tokens = sum(bit[x] for x in leaves if isinstance(x, Token))
    ends = sorted({e for x in leaves for low, high in lead(x) for e in (low, high + 1)})
    holders = [0] * len(ends)  # piece [ends[i], ends[i + 1]) -> terminals holding it
    pieces = {}
    for x in leaves:
        pieces[x] = [
            i
            for low, high in lead(x)
            for i in range(bisect_left(ends, low), bisect_left(ends, high + 1))
        ]
        for i in pieces[x]:
            holders[i] |= bit[x]
    everything = sum(bit.values())
    overlap = {}
    for x in leaves:
        if isinstance(x, Token):
            overlap[x] = everything
        else:
            overlap[x] = tokens
            for i in pieces[x]:
                overlap[x] |= holders[i]
    return overlap


def _members(mask: int, leaves: list) -> Iterable[object]:
    while mask:
        low = mask & -mask
        yield leaves[low.bit_length() - 1]
        mask ^= low


def _outermost(node: Item, qualifies: Callable[[Repeat], bool]) -> set[Repeat]:
    """The repetitions in `node` that qualify and lie inside no other that does."""
    if isinstance(node, Repeat):
        return {node} if qualifies(node) else _outermost(node.item, qualifies)
    if isinstance(node, Alternatives):
        return set().union(*(_outermost(x, qualifies) for seq in node.options for x in seq))
    return set()


def _regular_sizes(rules: Rules) -> dict[str, float]:
    """The rules that are regular expressions (no tokens, no recursion, only such rules
    used), with how many nodes each has, its rules written out. Found leaves first: a
    rule once every rule it uses is."""
    waiting = {name: refs(body) for name, body in rules.items() if not _has_token(body)}
    used_by = users(rules)
    sizes: dict[str, float] = {}
    todo = [name for name, used in waiting.items() if not used]
    while todo:
        name = todo.pop()
        sizes[name] = _size(rules[name], sizes)
        for user in used_by[name]:
            if user in waiting:
                waiting[user].discard(name)
                if not waiting[user]:
                    todo.append(user)
    return sizes


def _has_token(node: Item) -> bool:
    if isinstance(node, Token):
        return True
    if isinstance(node, Repeat):
        return _has_token(node.item)
    if isinstance(node, Alternatives):
        return any(_has_token(x) for seq in node.options for x in seq)
    return False


def _size(node: Item, sizes: dict[str, float]) -> float:
    """How many nodes `node` has with its rules written out (inf: not regular)."""
    if isinstance(node, Token):
        return float("inf")
    if isinstance(node, Ref):
        return sizes.get(node.name, float("inf"))
    if isinstance(node, Repeat):
        return 1 + _size(node.item, sizes)
    if isinstance(node, Alternatives):
        return 1 + sum(_size(x, sizes) for seq in node.options for x in seq)
    return 1


def _rules_used(node: Item, rules: Rules) -> set[str]:
    """The rules `node` uses, and those they use, and so on."""
    found: set[str] = set()
    todo = list(refs(node))
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += refs(rules[name])
    return found


# --- sets of characters ---


def _chars(leaf: object) -> CharSet:
    """The characters a one-character terminal matches (none for a token or the end)."""
    if not isinstance(leaf, Chars):
        return ()
    merged = _union([tuple(leaf.ranges)])
    if not leaf.negated:
        return merged
    out, at = [], 0
    for low, high in merged:
        if low > at:
            out.append((at, low - 1))
        at = high + 1
    if at <= MAX_CHAR:
        out.append((at, MAX_CHAR))
    return tuple(out)


def _union(sets: Iterable[CharSet]) -> CharSet:
    merged: list[list[int]] = []
    for low, high in sorted(r for s in sets for r in s):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return tuple((low, high) for low, high in merged)


def _intersects(a: CharSet, b: CharSet) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False
