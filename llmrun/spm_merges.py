"""SentencePiece BPE merges, derived from a vocabulary and its scores (GGUF stores no merges for
tokenizer.ggml.model "llama").

llama.cpp merges the adjacent pair whose joined token scores highest, leftmost first on a tie.
Ranking every split of every token into two vocabulary tokens by that token's score gives the
same order; among equal scores (Llama's runs of spaces) longer tokens and longer left parts rank
first, which reproduces the leftmost-first growth of a run, and the texts settle what ties
remain. `spm_merges_reference` is that definition as a plain loop; `spm_merges` computes the
same list with numpy (a 262,144-token vocabulary in a fraction of the time): it hashes every
prefix and suffix of every token at once, looks the hashes up among the tokens' own, and checks
each hit against the characters themselves, so a hash collision can cost time, never an id.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_MASK = (1 << 64) - 1
_SPREAD = np.uint64(0xD6E8FEB86659FD93)  # odd: a table slot from the top bits of hash * it
_CHUNK = 1 << 15  # tokens whose splits are looked for at once (bounds the memory used)


def spm_merges_reference(vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split (left, right) of every token into two vocabulary tokens, best first."""
    found = []
    add = found.append
    for token, i in vocab.items():
        n = len(token)
        score = -scores[i]
        for cut in range(1, n):
            left = token[:cut]
            if left in vocab and (right := token[cut:]) in vocab:
                add((score, -n, -cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def spm_merges(vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """`spm_merges_reference`, vectorised. It takes the plain loop where numpy cannot be exact:
    two tokens of one hash, a NaN score (no numeric order), a token that is not UTF-8."""
    texts = list(vocab)
    splits = _Splits.of(texts, vocab, scores) if texts else None
    if splits is None:
        return spm_merges_reference(vocab, scores) if texts else []
    left, right = splits.ranked()
    objects = np.array(texts, dtype=object)
    return list(zip(objects[left].tolist(), objects[right].tolist(), strict=True))


class _Splits:
    """The vocabulary's texts as one array of code points, with every prefix's hash."""

    def __init__(self, texts: list[str], ids: np.ndarray, score: np.ndarray, units: np.ndarray):
        self.texts, self.ids, self.score, self.units = texts, ids, score, units
        self.lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        self.ends = np.cumsum(self.lengths)
        self.starts = self.ends - self.lengths
        self.longest = int(self.lengths.max()) + 1
        local = np.arange(len(units))
        local -= np.repeat(self.starts, self.lengths)  # each character's place in its token
        # h(s) = sum((s[k] + 1) * BASE**k) mod 2**64 (uint64 arithmetic wraps): the running
        # sum over all texts gives every prefix's hash, and (whole - prefix) / BASE**cut every
        # suffix's.
        terms = _powers(_BASE, self.longest)[local]
        del local
        terms *= units + np.uint64(1)
        self.running = np.zeros(len(units) + 1, dtype=np.uint64)
        np.cumsum(terms, out=self.running[1:])
        self.whole = self.running[self.ends] - self.running[self.starts]
        self.inverse = _powers(pow(_BASE, -1, 1 << 64), self.longest)

    @classmethod
    def of(cls, texts: list[str], vocab: dict[str, int], scores: Sequence[float]) -> _Splits | None:
        try:
            # gguf_io keeps tokens that are not UTF-8 as surrogate escapes; a vocabulary for
            # the tokenizers library holds none, but one that does takes the plain loop.
            units = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
        except UnicodeEncodeError:
            return None
        score = np.asarray(scores, dtype=np.float64)
        if np.isnan(score).any():
            return None
        ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(texts))
        splits = cls(texts, ids, score, units)
        hashes = np.sort(splits.whole)
        if (hashes[1:] == hashes[:-1]).any():  # a lookup by hash could find the wrong one
            return None
        if len(texts) * splits.longest**2 >= 1 << 62:  # no room for the sort key of `ranked`
            return None
        return splits

    def ranked(self) -> tuple[np.ndarray, np.ndarray]:
        """The (left, right) parts of every split, best first, as places in the texts."""
        find = _Lookup(self.whole)
        count = len(self.texts)
        parts = [self._found(find, lo, min(lo + _CHUNK, count)) for lo in range(0, count, _CHUNK)]
        token, cut, left, right = (np.concatenate(p) for p in zip(*parts, strict=True))
        # By score (best first), then length and cut (longest first), as one integer key.
        n = self.longest
        by_score = _dense_rank(-self.score[self.ids])
        key = (by_score[token] * n + (n - self.lengths[token])) * n + (n - cut)
        order = np.argsort(key, kind="stable")
        token, left, right, key = token[order], left[order], right[order], key[order]
        # Equal keys are ordered by the token's text: it is the left part, then the right one,
        # and tied splits have parts of the same lengths. Only tied tokens are compared.
        tied = key[1:] == key[:-1]
        if tied.any():
            in_tie = np.zeros(len(token), dtype=bool)
            in_tie[1:] |= tied
            in_tie[:-1] |= tied
            ties = np.unique(token[in_tie]).tolist()
            rank = np.zeros(len(self.texts), dtype=np.int64)
            rank[sorted(ties, key=self.texts.__getitem__)] = np.arange(len(ties))
            order = np.lexsort((rank[token], key))
            left, right = left[order], right[order]
        return left, right

    def _found(self, find: _Lookup, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """(token, cut, left, right) of the splits of tokens lo..hi-1."""
        lengths, starts, ends, running = self.lengths, self.starts, self.ends, self.running
        # Every cut: each character of these tokens but the first of each.
        at = np.arange(starts[lo], ends[hi - 1])
        token = np.repeat(np.arange(lo, hi), lengths[lo:hi])
        cut = at - starts[token]
        at, token, cut = at[cut > 0], token[cut > 0], cut[cut > 0]
        left, found = find(running[at] - running[starts[token]])
        keep = found & (lengths[left] == cut)
        at, token, cut, left = at[keep], token[keep], cut[keep], left[keep]
        with np.errstate(over="ignore"):
            right, found = find((running[ends[token]] - running[at]) * self.inverse[cut])
        keep = found & (lengths[right] == lengths[token] - cut)
        token, cut, left, right = token[keep], cut[keep], left[keep], right[keep]
        exact = self._same_text(token, cut, left, right)
        return tuple(a[exact].astype(np.int32) for a in (token, cut, left, right))

    def _same_text(
        self, token: np.ndarray, cut: np.ndarray, left: np.ndarray, right: np.ndarray
    ) -> np.ndarray:
        """Whether each token's characters are its left part's, then its right part's."""
        size = self.lengths[token]
        if not len(size):
            return np.zeros(0, dtype=bool)
        first = np.cumsum(size) - size
        split = np.repeat(np.arange(len(token)), size)
        place = np.arange(int(size.sum())) - first[split]
        starts = self.starts
        part = np.where(place < cut[split], starts[left][split], starts[right][split] - cut[split])
        same = self.units[starts[token][split] + place] == self.units[part + place]
        return np.logical_and.reduceat(same, first)


def _dense_rank(values: np.ndarray) -> np.ndarray:
    """0 for the smallest value, 1 for the next distinct one, and so on (-0.0 equals 0.0)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    rank = np.empty(len(values), dtype=np.int64)
    rank[order] = np.concatenate([[0], np.cumsum(ordered[1:] != ordered[:-1])])
    return rank


def _powers(base: int, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.uint64)
    value = 1
    for k in range(count):
        out[k] = value
        value = value * base & _MASK
    return out


class _Lookup:
    """The token (by place in the vocabulary) of each of many hashes, by one gather from a
    table of slots; hashes of tokens that share a slot are searched for instead."""

    def __init__(self, hashes: np.ndarray) -> None:
        bits = max(8, (4 * len(hashes)).bit_length())
        self._shift = np.uint64(64 - bits)
        self._hashes = hashes
        slot = self._slot(hashes)
        alone = np.bincount(slot, minlength=1 << bits)[slot] == 1
        self._slots = np.full(1 << bits, -1, dtype=np.int32)
        self._slots[slot[alone]] = np.flatnonzero(alone)
        self._slots[slot[~alone]] = -2
        shared = np.flatnonzero(~alone)
        order = np.argsort(hashes[shared])
        self._shared, self._shared_at = hashes[shared][order], shared[order]

    def _slot(self, hashes: np.ndarray) -> np.ndarray:
        # A short text's hash has few high bits (one character's is its code point), so the
        # bits are spread before the top ones pick the slot.
        with np.errstate(over="ignore"):
            return (hashes * _SPREAD) >> self._shift

    def __call__(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The token of each query hash, and whether there is one."""
        at = self._slots[self._slot(queries)]
        found = (at >= 0) & (self._hashes[at] == queries)
        shared = np.flatnonzero(at == -2)
        if shared.size:
            where = np.searchsorted(self._shared, queries[shared])
            where = np.minimum(where, len(self._shared) - 1)
            at[shared] = self._shared_at[where]
            found[shared] = self._shared[where] == queries[shared]
        return at, found
