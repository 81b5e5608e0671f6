"""llama.cpp's WordPiece tokenizer (WPM, GGUF `tokenizer.ggml.model` "bert": the BERT-family
embedders with BERT's vocabulary, bge, all-MiniLM, nomic-embed-text, ...) as a `tokenizers`
backend that gives its ids exactly.

llama.cpp (src/llama-vocab.cpp llm_tokenizer_wpm_session) reads the text code point by
code point: with strip_accents, each one becomes the first code point of its NFD form
(so "Ä" is "A", its mark gone with the rest); whitespace ends a word; NUL, U+FFFD and
control characters (\\p{C}, whitespace aside; unassigned ones are kept) are dropped, as are
marks (\\p{M}) with strip_accents; lowercase maps each code point to its simple lowercase;
punctuation, ASCII symbols and CJK ideographs are words of their own. Each word is then
matched greedily, longest first, against the vocabulary, whose word-initial pieces the
converter stored with a "\u2581" before them and continuations as they are (BERT's "##"
removed); a word any part of which matches nothing is one [UNK].

That is the `tokenizers` WordPiece model over a vocabulary spelled BERT's way back ("##"
continuations), after a normalizer and a pre-tokenizer that do what llama.cpp does: the
normalizer in Python (unicodedata's categories are the Unicode tables llama.cpp generates
its own from), the word splits as regular expressions.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from gguf import TokenType
from tokenizers import NormalizedString, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordPiece

PHANTOM_SPACE = "\u2581"  # conversion/bert.py's mark of a word-initial piece
CONTINUATION = "##"
# GGUF keys of BertNormalizer's options (gguf-py's Keys.Tokenizer.NORMALIZER_*; the installed
# gguf package predates them). llama.cpp: lowercase unless the file says not, and strip
# accents as it lowercases unless the file says otherwise.
LOWERCASE_KEY = "tokenizer.ggml.normalizer.lowercase"
STRIP_ACCENTS_KEY = "tokenizer.ggml.normalizer.strip_accents"
# One-character words: punctuation, ASCII symbols (\p{S} below 0x7F) and llm_tokenizer_wpm's
# CJK ranges (its 0x2B920 start, where Unicode's block starts at 0x2B820, is the HF one).
_SINGLES = (
    "\\p{P}|[$+<=>^`|~]|[\\x{4e00}-\\x{9fff}\\x{3400}-\\x{4dbf}\\x{20000}-\\x{2a6df}"
    "\\x{2a700}-\\x{2b73f}\\x{2b740}-\\x{2b81f}\\x{2b920}-\\x{2ceaf}\\x{f900}-\\x{faff}"
    "\\x{2f800}-\\x{2fa1f}]"
)
_DROPPED_CATEGORIES = ("Cc", "Cf", "Co", "Cs")  # \p{C} but unassigned (Cn)
# llama.cpp's whitespace (scripts/gen-unicode-data.py: Unicode's White_Space).
_WHITESPACE_CHARS = frozenset(
    [*map(chr, range(0x9, 0xE)), " ", "\x85", "\xa0", "\u1680"]
    + [chr(c) for c in range(0x2000, 0x200B)]
    + ["\u2028", "\u2029", "\u202f", "\u205f", "\u3000"]
)
_WHITESPACE = "".join(f"\\x{{{ord(c):x}}}" for c in sorted(_WHITESPACE_CHARS))


class _Normalizer:
    """llm_tokenizer_wpm_session::preprocess's changes to the characters (not its splits)."""

    def __init__(self, lowercase: bool, strip_accents: bool) -> None:
        self.lowercase, self.strip_accents = lowercase, strip_accents

    def normalize(self, text: NormalizedString) -> None:
        if self.strip_accents:
            text.map(_nfd_first)
        text.filter(self._kept)
        if self.lowercase:
            text.map(_simple_lower)

    def _kept(self, char: str) -> bool:
        if char in _WHITESPACE_CHARS:
            return True
        if char in ("\0", "\ufffd"):
            return False
        category = unicodedata.category(char)
        if category in _DROPPED_CATEGORIES:
            return False
        return not (self.strip_accents and category.startswith("M"))


def _nfd_first(char: str) -> str:
    return unicodedata.normalize("NFD", char)[0]


def _simple_lower(char: str) -> str:
    # UnicodeData's simple mapping: the full one's first character where that has more
    # (U+0130's "i\u0307" is "i").
    return char.lower()[0]


def wordpiece_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """The GGUF vocabulary spelled as BERT's (word-initial pieces bare, continuations after
    "##"; control tokens as they are), the later id winning as in llama.cpp."""
    vocab = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == TokenType.CONTROL:
            text = token
        elif token.startswith(PHANTOM_SPACE):
            text = token[len(PHANTOM_SPACE) :]
        else:
            text = CONTINUATION + token
        if text and text != CONTINUATION:
            vocab[text] = i
    return vocab


def wordpiece_backend(
    metadata: dict[str, Any], tokens: list[str], types: list[int], unk: int | None
) -> Backend:
    """The backend of a "bert" GGUF vocabulary that tokenizes as llama.cpp's WPM."""
    vocab = wordpiece_vocab(tokens, types)
    unk_text = next((t for t, i in vocab.items() if i == unk), None)
    model = WordPiece(
        vocab,
        unk_token=unk_text or "[UNK]",
        continuing_subword_prefix=CONTINUATION,
        # llama.cpp matches words of any length.
        max_input_chars_per_word=1 << 30,
    )
    backend = Backend(model)
    lowercase = bool(metadata.get(LOWERCASE_KEY, True))
    strip_accents = bool(metadata.get(STRIP_ACCENTS_KEY, lowercase))
    backend.normalizer = normalizers.Normalizer.custom(_Normalizer(lowercase, strip_accents))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(f"[{_WHITESPACE}]+"), "removed"),
            pre_tokenizers.Split(Regex(_SINGLES), "isolated"),
        ]
    )
    return backend
