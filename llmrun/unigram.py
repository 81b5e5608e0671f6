"""llama.cpp's Unigram tokenizer (UGM, GGUF `tokenizer.ggml.model` "t5": SentencePiece Unigram
vocabularies of T5, XLM-RoBERTa, bge-m3, multilingual-e5) as a `tokenizers` backend that gives
its ids exactly.

llama.cpp (src/llama-vocab.cpp llm_tokenizer_ugm_session) first normalizes each run of text:
from every position, the longest prefix the precompiled charsmap holds
(`tokenizer.ggml.precompiled_charsmap`, SentencePiece's darts-clone double array of UTF-8
keys and NUL-terminated replacements) is replaced, else the character kept; then each ASCII
space becomes "\u2581", with `tokenizer.ggml.remove_extra_whitespaces` runs of spaces are
dropped and every word gets one "\u2581" before it, and `tokenizer.ggml.add_space_prefix`
puts one before the first word. The normalizer does that here, in Python: the `tokenizers`
library's Precompiled normalizer matches the charsmap per grapheme, not longest prefix first.

The Viterbi search is the `tokenizers` Unigram model's, which is llama.cpp's: left to right a
character at a time, every token that starts there tried, a strict ">" so that the first best
path found stays, sums in f64 of the f32 scores, a character no token covers alone scored 10
below the lowest score (llama.cpp rounds that to f32: under 2e-6 apart, which only a tie as
close could tell), runs of such unknowns fused into one <unk>. It holds, at the file's ids,
what llama.cpp's trie holds: the normal, user-defined (scored 0, as llama.cpp scores them)
and unused tokens, by the file's token types. Every other id (control, unknown, byte) holds
an empty piece, which no text matches, scored as the lowest normal token, so that the lowest
score the model holds is llama.cpp's, the lowest normal one. Unused tokens scored lower still
(the converter's [PADn] fillers: -1000 and -10000) are such empty pieces too: llama.cpp would
take one only where every other path through its text scored lower (for -10000, hundreds of
unknown characters inside "[PADn]").
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from gguf import Keys, TokenType
from tokenizers import NormalizedString, normalizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import Unigram

from llmrun.errors import TokenizerError

SPACE = "\u2581"
CHARSMAP_KEY = Keys.Tokenizer.PRECOMPILED_CHARSMAP


class Charsmap:
    """A precompiled charsmap, matched as llama.cpp's normalize_prefix matches it.

    The blob is a little-endian u32 size, that many bytes of XOR-compressed double-array
    units, then the NUL-terminated replacements. From a text position, the walk starts at
    index BASE(unit 0); for each byte: index ^= byte, the unit there must have the byte as
    LCHECK (bits 0-7 and 31), and index ^= its BASE (bits 10-30, shifted left by 8 where bit
    9 is set); where that unit's LEAF (bit 8) was set, the key so far matches, and the unit
    reached holds its replacement's offset (bits 0-30). The longest match wins; a NUL byte
    ends the walk. nmt_nfkc's charsmap holds over 200,000 keys, so they are walked to, not
    listed."""

    def __init__(self, blob: bytes, source: str) -> None:
        if len(blob) < 4:
            raise TokenizerError(f"{source}: {CHARSMAP_KEY} is too short ({len(blob)} bytes)")
        size = int.from_bytes(blob[:4], "little")
        if size + 4 >= len(blob) or size % 4:
            raise TokenizerError(
                f"{source}: {CHARSMAP_KEY} says its trie has {size} bytes, "
                f"but the charsmap has {len(blob)}"
            )
        self.replacements = blob[4 + size :]
        if not self.replacements.endswith(b"\0"):
            raise TokenizerError(f"{source}: {CHARSMAP_KEY} ends inside a replacement")
        self.units = np.frombuffer(blob, "<u4", size // 4, 4).tolist()
        self.root = self._base(self.units[0]) if self.units else 0
        # Lead bytes of some key (never UTF-8 continuation bytes: the walk starts only at a
        # character), to skip to the next place a key can start.
        leads = [b for b in range(1, 256) if not 0x80 <= b < 0xC0 and self._is_child(b)]
        escaped = b"".join(re.escape(bytes((b,))) for b in leads)
        self.start = re.compile(b"[" + escaped + b"]") if leads else None
        self._texts: dict[int, bytes] = {}

    @staticmethod
    def _base(unit: int) -> int:
        return (unit >> 10) << ((unit & (1 << 9)) >> 6)

    def _is_child(self, byte: int) -> bool:
        """Whether a key starts with `byte` (the walk's first step, as in `replace`)."""
        index = self.root ^ byte
        return index < len(self.units) and self.units[index] & 0x800000FF == byte

    def replace(self, text: str) -> str:
        """`text` with the longest key at each position replaced, left to right."""
        if self.start is None:
            return text
        data = text.encode("utf-8")
        units, size, root, out, done = self.units, len(self.units), self.root, [], 0
        at = self.start.search(data)
        while at is not None:
            i = at.start()
            node, longest, offset = root, 0, 0
            for j in range(i, len(data)):
                byte = data[j]
                index = node ^ byte
                # A NUL ends the walk; where the index is out of bounds, llama.cpp's throws.
                if not byte or index >= size or units[index] & 0x800000FF != byte:
                    break
                unit = units[index]
                node = index ^ ((unit >> 10) << ((unit & 0x200) >> 6))
                if unit & 0x100 and node < size:
                    longest, offset = j + 1 - i, units[node] & 0x7FFFFFFF
            if longest and offset < len(self.replacements):
                out += [data[done:i], self._text(offset)]
                done = i + longest
            at = self.start.search(data, max(done, i + 1))
        return b"".join(out + [data[done:]]).decode("utf-8", "replace") if out else text

    def _text(self, offset: int) -> bytes:
        text = self._texts.get(offset)
        if text is None:
            end = self.replacements.index(b"\0", offset)
            text = self._texts[offset] = self.replacements[offset:end]
        return text


class UnigramNormalizer:
    """llm_tokenizer_ugm_session::normalize: the charsmap's replacements, then the spaces.

    llama.cpp's normalize_prefix first keeps any user-defined token's text as it is; no run
    of text holds one by then (llama.cpp's partition, and tokenizer_gguf's splitter, take
    every user-defined token out of the text first), so that check is not repeated here."""

    def __init__(
        self, charsmap: Charsmap | None, add_space_prefix: bool, merge_spaces: bool
    ) -> None:
        self.charsmap = charsmap
        self.add_space_prefix, self.merge_spaces = add_space_prefix, merge_spaces

    def normalize(self, normalized: NormalizedString) -> None:
        text = normalized.normalized
        new = self(text)
        if new != text:
            normalized.replace(text, new)

    def __call__(self, text: str) -> str:
        if self.charsmap is not None:
            text = self.charsmap.replace(text)
        if self.merge_spaces:
            return "".join(SPACE + word for word in text.split(" ") if word)
        if self.add_space_prefix:
            words = text.lstrip(" ")
            if words:
                text = text[: len(text) - len(words)] + " " + words
        return text.replace(" ", SPACE)


def unigram_backend(
    metadata: dict[str, Any],
    tokens: list[str],
    types: list[int],
    scores: list[float],
    unk: int,
    add_space_prefix: bool,
    source: str,
) -> Backend:
    """The backend of a "t5" GGUF vocabulary that tokenizes as llama.cpp's UGM."""
    scores = [float(s) for s in scores]
    normal = [s for s, t in zip(scores, types, strict=True) if t == TokenType.NORMAL]
    if not normal:
        raise TokenizerError(f"{source}: a Unigram vocabulary without normal tokens")
    lowest = min(normal)
    # The library holds only UTF-8 text; a token that is not can match no text here.
    try:
        "".join(tokens).encode("utf-8")
        texts = tokens
    except UnicodeEncodeError:
        texts = [t if _is_utf8(t) else "" for t in tokens]
    pieces = []
    for text, kind, score in zip(texts, types, scores, strict=True):
        if kind == TokenType.NORMAL or (kind == TokenType.UNUSED and score >= lowest):
            pieces.append((text, score))
        elif kind == TokenType.USER_DEFINED:
            pieces.append((text, 0.0))
        else:
            pieces.append(("", lowest))
    backend = Backend(Unigram(pieces, unk_id=unk, byte_fallback=False))
    blob = metadata.get(CHARSMAP_KEY)
    charsmap = None if blob is None else Charsmap(_as_bytes(blob, source), source)
    backend.normalizer = normalizers.Normalizer.custom(
        UnigramNormalizer(
            charsmap,
            add_space_prefix=add_space_prefix,
            merge_spaces=bool(metadata.get(Keys.Tokenizer.REMOVE_EXTRA_WS, False)),
        )
    )
    return backend


def _as_bytes(values: Any, source: str) -> bytes:
    if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
        raise TokenizerError(f"{source}: {CHARSMAP_KEY} is not an array of bytes")
    return bytes(v & 0xFF for v in values)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
