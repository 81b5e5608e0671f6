"""llama.cpp's RWKV "world" tokenizer (GGUF `tokenizer.ggml.model` "rwkv": RWKV-6 and RWKV-7
world models) as a backend that gives its ids exactly.

The vocabulary is of byte strings. llama.cpp's converter writes each one as Python's repr of
the bytes without the b'' (so "\\n", "\\xe4", "\\\\"), and llama.cpp undoes that
(llama_unescape_rwkv_token: \\t \\n \\r, \\xHH, and a backslash before any other character
keeps the character). Its tokenizer (llm_tokenizer_rwkv_session) walks a trie of every token
of the file, control and unused ones included, and from each byte of the text takes the
longest token that matches there, as BlinkDL's TRIE_TOKENIZER does; a byte no token starts
with (none, in the world vocabulary: it holds all 256) becomes the unknown token.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, NamedTuple

from gguf import Keys, TokenType

from llmrun.errors import TokenizerError

# BlinkDL's world vocabulary, as fla-hub's RWKV folders ship it: "id repr(bytes) length" a line.
VOCAB_FILE = "rwkv_vocab_v20230424.txt"
# llama.cpp's converter makes "\n\n" (this id in the world vocabulary) the end of a turn.
TURN_END = 261
# A prefix of some token that is not itself one.
_PREFIX = -1
_ESCAPES = {ord("t"): 9, ord("n"): 10, ord("r"): 13}


class Encoding(NamedTuple):
    """One text's ids, as the tokenizers library's Encoding holds them."""

    ids: list[int]


def unescape(text: str) -> bytes:
    """A token's bytes from its GGUF text, as llama_unescape_rwkv_token reads it."""
    if "\\" not in text:
        return text.encode("utf-8")
    out = bytearray()
    data = text.encode("utf-8")
    at = 0
    while at < len(data):
        byte = data[at]
        if byte != ord("\\") or at + 1 >= len(data):
            out.append(byte)
            at += 1
            continue
        escaped = data[at + 1]
        if escaped == ord("x"):
            out.append(int(data[at + 2 : at + 4], 16))
            at += 4
        else:
            out.append(_ESCAPES.get(escaped, escaped))
            at += 2
    return bytes(out)


class RwkvBackend:
    """The part of the tokenizers library's Tokenizer that llmrun.tokenizer.Tokenizer calls
    (`encode`, `encode_batch_fast`, `token_to_id`, `add_tokens`, `encode_special_tokens`),
    matching the longest token at each byte."""

    def __init__(self, tokens: list[str], unk_id: int | None) -> None:
        self.spellings = [unescape(t) for t in tokens]
        # Every token and every prefix of one, so the walk stops where no token goes on;
        # where two ids spell the same bytes the later wins, as in llama.cpp's trie.
        self._trie: dict[bytes, int] = {}
        for i, spelled in enumerate(self.spellings):
            for end in range(1, len(spelled)):
                self._trie.setdefault(spelled[:end], _PREFIX)
            if spelled:
                self._trie[spelled] = i
        self._unk = unk_id
        self.encode_special_tokens = False  # moot: the trie holds the special tokens too

    def add_tokens(self, tokens: list[Any]) -> None:
        """Nothing to add: the trie holds every token of the file already."""

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        """`text`'s ids, the longest token at each position of its UTF-8 bytes; TypeError for
        text that is not UTF-8, as the library raises."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TypeError(str(e)) from None
        trie, ids, at, n = self._trie, [], 0, len(data)
        while at < n:
            best, best_end, end = None, at + 1, at + 1
            while end <= n:
                found = trie.get(data[at:end])
                if found is None:
                    break
                if found != _PREFIX:
                    best, best_end = found, end
                end += 1
            if best is None:
                if self._unk is not None:
                    ids.append(self._unk)
            else:
                ids.append(best)
            at = best_end
        return Encoding(ids)

    def encode_batch_fast(
        self, texts: list[str], add_special_tokens: bool = False
    ) -> list[Encoding]:
        return [self.encode(t) for t in texts]

    def token_to_id(self, text: str) -> int | None:
        found = self._trie.get(text.encode("utf-8"))
        return None if found is None or found == _PREFIX else found


def applies(folder: Path) -> bool:
    """Whether a model folder's tokenizer is the world vocabulary file (fla-hub's RWKV)."""
    return (folder / VOCAB_FILE).is_file()


def folder_metadata(folder: Path, vocab_size: int) -> dict[str, Any]:
    """The GGUF tokenizer metadata llama.cpp's converter writes of a folder's world vocabulary
    (_set_vocab_rwkv_world): "<s>" (control) first, each line's bytes as Python's repr
    without b'', [PADn] fillers (unused) up to `vocab_size`, bos = eos = 0, "\n\n" ending
    a turn. Each line's token is read with ast.literal_eval (literals only, never code)."""
    path = folder / VOCAB_FILE
    tokens, types = ["<s>"], [int(TokenType.CONTROL)]
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        parts = line.split(" ")
        try:
            token = ast.literal_eval(" ".join(parts[1:-1]))
            length = int(parts[-1])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            token, length = None, -1
        token = token.encode("utf-8") if isinstance(token, str) else token
        if not isinstance(token, bytes) or len(token) != length:
            raise TokenizerError(f"{path}: line {number} is not 'id token length'")
        tokens.append(repr(token)[2:-1])
        types.append(int(TokenType.NORMAL))
    if len(tokens) > vocab_size:
        raise TokenizerError(f"{path}: {len(tokens)} tokens, but the model has {vocab_size}")
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
    return {
        Keys.Tokenizer.MODEL: "rwkv",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.TOKEN_TYPE: types,
        Keys.Tokenizer.BOS_ID: 0,
        Keys.Tokenizer.EOS_ID: 0,
        Keys.Tokenizer.EOT_ID: TURN_END,
    }
