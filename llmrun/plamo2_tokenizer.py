"""PLaMo 2's tokenizer (GGUF `tokenizer.ggml.model` "plamo2": PLaMo 2 and 3) as a backend
that gives llama.cpp's ids exactly.

Its vocabulary is the folder's tokenizer.jsonl, a JSON list a line: [token, score, type, ...],
the type "UNKNOWN", "CONTROL", "BYTE" or another (normal). Its tokenizer
(llm_tokenizer_plamo2 in llama.cpp's llama-vocab.cpp, the Hub's tokenization_plamo.py) is a
Viterbi search over Unicode characters from the end of the text: at each character it tries
every token but the byte ones (control ones included) that starts there, longest first, at
the cost of round(score * 1e4) in integers, and a character no token covers as its UTF-8
bytes' byte tokens (at a cost of 1e7); a strictly better cost wins, so among equals the
longer token. It finds the tokens starting at a character through the longest string of
the vocabulary's suffixes that does (an Aho-Corasick walk), including its one quirk: a
token scored -1000 (1e7 in integers, the unknown cost) ends both walks where it is met.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import Keys, TokenType

from llmrun.errors import TokenizerError

VOCAB_FILE = "tokenizer.jsonl"
MODEL = "plamo2"
INVALID_SCORE = -20_000_000  # a suffix that is no token
UNKNOWN_SCORE = -10_000_000  # a character no token covers
# llama.cpp's converter makes <|plamo:op|> (this id) end a turn (_set_vocab_plamo).
TURN_END = 4
_TYPES = {"UNKNOWN": TokenType.UNKNOWN, "CONTROL": TokenType.CONTROL, "BYTE": TokenType.BYTE}
_CONTROL = ("<|plamo:", "|>")  # a normal line's token of this form is a control token
_SPECIAL_KEYS = {
    "bos_token": Keys.Tokenizer.BOS_ID,
    "eos_token": Keys.Tokenizer.EOS_ID,
    "pad_token": Keys.Tokenizer.PAD_ID,
    "sep_token": Keys.Tokenizer.SEP_ID,
    "unk_token": Keys.Tokenizer.UNK_ID,
}


class Encoding(NamedTuple):
    """One text's ids, as the tokenizers library's Encoding holds them."""

    ids: list[int]


def _fixed(score: float) -> int:
    """A score in the search's integers: round(score * 1e4), halves away from zero as C++'s
    std::round; INVALID_SCORE where it is not finite."""
    scaled = score * 1e4
    if not math.isfinite(scaled):
        return INVALID_SCORE
    return int(math.copysign(math.floor(abs(scaled) + 0.5), scaled))


def _byte_of(text: str) -> int | None:
    """The byte a "<0xHH>" token stands for, else None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


class Plamo2Backend:
    """The part of the tokenizers library's Tokenizer that llmrun.tokenizer.Tokenizer calls
    (`encode`, `encode_batch_fast`, `token_to_id`, `add_tokens`, `encode_special_tokens`)."""

    def __init__(self, tokens: list[str], types: list[int], scores: list[float]) -> None:
        # Every non-byte token with its score and every suffix of one (INVALID_SCORE where
        # it is no token); where two tokens spell the same, the later's id and score.
        self._scores: dict[str, int] = {}
        self._ids: dict[str, int] = {}
        self._bytes: list[int | None] = [None] * 256
        for i, (text, kind, score) in enumerate(zip(tokens, types, scores, strict=True)):
            self._ids[text] = i
            if kind == TokenType.BYTE:
                byte = _byte_of(text)
                if byte is not None:
                    self._bytes[byte] = i
                continue
            self._scores[text] = _fixed(score)
            for start in range(1, len(text)):
                self._scores.setdefault(text[start:], INVALID_SCORE)
        missing = [f"<0x{b:02X}>" for b, i in enumerate(self._bytes) if not i]
        if missing:
            raise TokenizerError(f"PLaMo 2 vocabulary without the byte tokens {missing[:4]}")
        self.encode_special_tokens = False  # moot: the search holds the special tokens too

    def add_tokens(self, tokens: list[Any]) -> None:
        """Nothing to add: the search holds every token of the file already."""

    def _pieces(self, suffix: str) -> list[tuple[str, int]]:
        """The suffix's prefixes that are suffixes of tokens, longest first, with scores."""
        found = []
        for length in range(len(suffix), 0, -1):
            score = self._scores.get(suffix[:length])
            if score is not None:
                found.append((suffix[:length], score))
        return found

    def _longest(self, char: str, after: str) -> str:
        """The longest suffix of a token that begins the text at `char`, from `after`, the
        one that begins it at the next character (the walk's step, its stop included)."""
        for piece, score in self._pieces(after):
            if char + piece in self._scores:
                return char + piece
            if score == UNKNOWN_SCORE:
                return ""
        return char if char in self._scores else ""

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        """`text`'s ids (llm_tokenizer_plamo2::encode); TypeError for text that is not
        UTF-8, as the library raises."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TypeError(str(e)) from None
        text = text.removeprefix("\ufeff")
        n = len(text)
        costs = [1 << 60] * n + [0]
        lengths, ids = [0] * (n + 1), [-1] * (n + 1)
        longest = ""
        for at in range(n - 1, -1, -1):
            longest = self._longest(text[at], longest)
            for piece, score in self._pieces(longest):
                if score > INVALID_SCORE and costs[at + len(piece)] - score < costs[at]:
                    costs[at] = costs[at + len(piece)] - score
                    lengths[at], ids[at] = len(piece), self._ids.get(piece, -1)
                if score == UNKNOWN_SCORE:
                    break
            else:  # the sentinel: the character as its bytes
                if costs[at + 1] - UNKNOWN_SCORE < costs[at]:
                    costs[at] = costs[at + 1] - UNKNOWN_SCORE
                    lengths[at], ids[at] = 1, -1
        out, at = [], 0
        while at < n:
            if ids[at] >= 0:
                out.append(ids[at])
            else:
                out.extend(self._bytes[b] for b in text[at].encode("utf-8"))
            at += lengths[at]
        return Encoding(out)

    def encode_batch_fast(
        self, texts: list[str], add_special_tokens: bool = False
    ) -> list[Encoding]:
        return [self.encode(t) for t in texts]

    def token_to_id(self, text: str) -> int | None:
        return self._ids.get(text)


def applies(folder: Path) -> bool:
    """Whether a model folder's tokenizer is PLaMo's tokenizer.jsonl."""
    return (folder / VOCAB_FILE).is_file()


def folder_metadata(folder: Path, vocab_size: int) -> dict[str, Any]:
    """The GGUF tokenizer metadata llama.cpp's converter writes of a folder's tokenizer.jsonl
    and tokenizer_config.json (_set_vocab_plamo): each line's token, score (as float32)
    and type, [PADn] fillers (unused, score -1000) up to `vocab_size`, the special tokens
    tokenizer_config.json names, <|plamo:op|> ending a turn."""
    path = folder / VOCAB_FILE
    tokens, scores, types = [], [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if (
            not isinstance(row, list)
            or len(row) < 2
            or not isinstance(row[0], str)
            or not isinstance(row[1], int | float)
        ):
            raise TokenizerError(f"{path}: line {number} is not [token, score, type, ...]")
        kind = _TYPES.get(row[2]) if len(row) > 2 else None
        if kind is None:
            control = row[0].startswith(_CONTROL[0]) and row[0].endswith(_CONTROL[1])
            kind = TokenType.CONTROL if control else TokenType.NORMAL
        tokens.append(row[0])
        scores.append(float(np.float32(row[1])))
        types.append(int(kind))
    if len(tokens) > vocab_size:
        raise TokenizerError(f"{path}: {len(tokens)} tokens, but the model has {vocab_size}")
    for i in range(1, vocab_size - len(tokens) + 1):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(int(TokenType.UNUSED))
    metadata: dict[str, Any] = {
        Keys.Tokenizer.MODEL: MODEL,
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.SCORES: scores,
        Keys.Tokenizer.TOKEN_TYPE: types,
        Keys.Tokenizer.EOT_ID: TURN_END,
    }
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    ids: dict[str, int] = {}
    for i, text in enumerate(tokens):
        ids.setdefault(text, i)  # the converter's tokens.index(): the first
    for name, key in _SPECIAL_KEYS.items():
        text = config.get(name)
        if isinstance(text, dict):  # an AddedToken's fields
            text = text.get("content")
        if text is None:
            continue
        if text not in ids:
            raise TokenizerError(f"{config_path}: {name} {text!r} is not in {path}")
        metadata[key] = ids[text]
    return metadata
