"""The bytes a token's stored text stands for: GPT-2's byte-level alphabet, SentencePiece's
U+2581 for a space and its <0xXX> byte tokens, or the text itself."""

from __future__ import annotations

import re

from llmrun.pretokenizers import SPM_SPACE

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(shifted))
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_chars()
BYTE_LEVEL_ALPHABET = "".join(_BYTE_OF_CHAR)  # the 256 characters


def byte_level_bytes(text: str) -> bytes:
    """A byte-level token's bytes."""
    # A token with characters outside the alphabet (an added token kept as plain text) is
    # literal, as in the ByteLevel decoder of `tokenizers`.
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in text)
    except KeyError:
        return raw(text)


def raw(text: str) -> bytes:
    """The text's own bytes."""
    # gguf_io keeps tokens that are not valid UTF-8 as surrogate escapes.
    return text.encode("utf-8", "surrogateescape")


def spm_bytes(text: str, byte_fallback: bool) -> bytes:
    """A SentencePiece token's bytes (a <0xXX> token is one byte where `byte_fallback`)."""
    if byte_fallback and (m := _BYTE_TOKEN.fullmatch(text)):
        return bytes([int(m.group(1), 16)])
    return raw(text.replace(SPM_SPACE, " "))
