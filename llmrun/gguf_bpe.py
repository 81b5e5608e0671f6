"""llama.cpp's merging for GGUF BPE and SentencePiece vocabularies, in C (native/tokenize.c).

Why not the `tokenizers` library's BPE: its constructor alone takes about 0.5 s for Gemma's
262,144 tokens and 514,906 merges, where the C tables take a few hundredths. The library still
does what it is quick at: the normalizer and the pre-tokenizer (llmrun.pretokenizers' Split
and ByteLevel steps) run before the merging, and a batch (`encode_batch_fast`) is encoded on
its threads by its own BPE, built at the first batch. Added (special and user-defined)
tokens are found as the library finds them, by its own matcher (an empty model that holds
only them), so a text cuts where the library's BPE would cut it.
Where the C library cannot be built (no compiler, LLMRUN_NATIVE=0), `merging_backend` gives
None and the library's BPE does all of it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from gguf import Keys
from tokenizers import AddedToken, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun import native
from llmrun.errors import TokenizerError
from llmrun.pretokenizers import SPM_SPACE

# tokenize.c's flags for llmrun_bpe_encode
_IGNORE_MERGES, _NEWLINE_WORDS, _BYTE_LEVEL = 1, 2, 4


class Encoding(NamedTuple):
    """One text's ids, as the library's Encoding holds them."""

    ids: list[int]


class _Vocab:
    """The C library's tables of one vocabulary, freed with this object."""

    def __init__(self, lib: ctypes.CDLL, handle: int) -> None:
        self.lib, self.handle = lib, handle

    def __del__(self) -> None:
        self.lib.llmrun_vocab_free(self.handle)


def _texts(texts: Sequence[str], errors: str = "strict") -> tuple[bytes, np.ndarray]:
    """Texts as tokenize.c takes them: their UTF-8 one after another, and each one's length
    in characters (fewer bytes to hand over than offsets, and no text is measured twice)."""
    chars = np.fromiter(map(len, texts), dtype=np.int32, count=len(texts))
    return "".join(texts).encode("utf-8", errors), chars


class MergingBackend:
    """The part of the library's Tokenizer that llmrun.tokenizer.Tokenizer calls (`encode`,
    `encode_batch_fast`, `token_to_id`, `encode_special_tokens`), merging in C."""

    def __init__(
        self,
        vocab: dict[str, int],
        tables: _Vocab,
        encode: Callable[[str], list[int]],
        batch_backend: Callable[[], Backend],
    ) -> None:
        self._vocab = vocab
        self._tables = tables
        self._encode = encode
        self._make_batch_backend = batch_backend
        self._batch_backend: Backend | None = None
        self._added: list[AddedToken] = []
        self._matcher: Backend | None = None
        self._matched_ids: dict[int, int] = {}  # the matcher's ids -> the vocabulary's
        self._first_chars: frozenset[str] = frozenset()  # where an added token can begin
        self.encode_special_tokens = False

    def add_tokens(self, tokens: list[AddedToken]) -> None:
        """The special and user-defined tokens: matched in a text before its plain runs
        are merged, and given to the library's BPE of batches."""
        self._added = tokens
        self._matcher = Backend(BPE({}, [])) if tokens else None  # plain text: no ids
        if self._matcher is not None:
            self._matcher.add_tokens(tokens)
            ids = {t.content: self._matcher.token_to_id(t.content) for t in tokens}
            self._matched_ids = {i: self._vocab[text] for text, i in ids.items()}
            self._first_chars = frozenset(text[0] for text in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        """`text`'s ids (`add_special_tokens` is moot: no post-processor); TypeError for
        text that is not UTF-8, as the library raises."""
        try:
            if self._matcher is None or self._first_chars.isdisjoint(text):
                return Encoding(self._encode(text))
            self._matcher.encode_special_tokens = self.encode_special_tokens
            found = self._matcher.encode(text, add_special_tokens=False)
            ids: list[int] = []
            at = 0
            for i, (start, end) in zip(found.ids, found.offsets, strict=True):
                ids += self._encode(text[at:start]) if start > at else []
                ids.append(self._matched_ids[i])
                at = end
            return Encoding(ids + self._encode(text[at:]) if at < len(text) else ids)
        except UnicodeEncodeError as e:
            raise TypeError(str(e)) from None

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool = False) -> list[Any]:
        """The texts' encodings by the library's BPE, on its threads."""
        backend = self._batch_backend
        if backend is None:
            backend = self._batch_backend = self._make_batch_backend()
            backend.add_tokens(self._added)
        backend.encode_special_tokens = self.encode_special_tokens
        return backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self._vocab.get(text)


def _tables(vocab: dict[str, int], n_tokens: int, scores: Sequence[float] | None) -> _Vocab | None:
    lib = native.tokenize_library()
    if lib is None:
        return None
    blob, chars = _texts(list(vocab))
    ids = np.fromiter(vocab.values(), dtype=np.int32, count=len(vocab))
    weights = None if scores is None else np.asarray(scores, dtype=np.float32)
    handle = lib.llmrun_vocab_new(
        blob,
        len(blob),
        chars.ctypes.data,
        ids.ctypes.data,
        len(vocab),
        n_tokens,
        None if weights is None else weights.ctypes.data,
    )
    return _Vocab(lib, handle) if handle else None


def bpe_backend(
    vocab: dict[str, int],
    n_tokens: int,
    merges: list[str],
    *,
    normalizer: normalizers.Normalizer | None,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    ignore_merges: bool,
    newline_words: bool,
    byte_level: bool,
    source: str,
    batch_backend: Callable[[], Backend],
) -> MergingBackend | None:
    """A byte-pair encoder of `merges` ("left right", rank by place) over the words
    `pre_tokenizer` cuts, as llama.cpp merges them; None without the C library."""
    tables = _tables(vocab, n_tokens, None)
    if tables is None:
        return None
    blob, chars = _texts(merges, "surrogatepass")
    found = tables.lib.llmrun_vocab_merges(
        tables.handle, blob, len(blob), chars.ctypes.data, len(merges)
    )
    if found == -1:
        return None
    if found < -1:
        bad = merges[-found - 2]
        raise TokenizerError(
            f"{source}: {Keys.Tokenizer.MERGES} does not fit {Keys.Tokenizer.LIST}: merge {-found - 2} ({bad!r}) "
            "names a token, or makes one, that is not in the vocabulary"
        )
    flags = (
        (_IGNORE_MERGES if ignore_merges else 0)
        | (_NEWLINE_WORDS if newline_words else 0)
        | (_BYTE_LEVEL if byte_level else 0)
    )
    encode_words = tables.lib.llmrun_bpe_encode
    normalize = normalizer.normalize_str if normalizer is not None else None
    split = pre_tokenizer.pre_tokenize_str

    def encode(text: str) -> list[int]:
        words = [word for word, _ in split(normalize(text) if normalize else text)]
        blob, chars = _texts(words)
        out = np.empty(len(blob), dtype=np.int32)
        n = encode_words(
            tables.handle, blob, len(blob), chars.ctypes.data, len(words), flags, out.ctypes.data
        )
        if n < 0:
            raise MemoryError("tokenizing ran out of memory")
        return out[:n].tolist()

    return MergingBackend(vocab, tables, encode, batch_backend)


def spm_backend(
    vocab: dict[str, int],
    n_tokens: int,
    scores: Sequence[float],
    *,
    unk: int | None,
    add_prefix: bool,
    batch_backend: Callable[[], Backend],
) -> MergingBackend | None:
    """A SentencePiece encoder by token score, over the text with its spaces escaped (and one
    put before it where `add_prefix`), as llama.cpp merges; None without the C library."""
    tables = _tables(vocab, n_tokens, scores)
    if tables is None:
        return None
    encode_text = tables.lib.llmrun_spm_encode
    unk_id = -1 if unk is None else unk

    def encode(text: str) -> list[int]:
        if not text:
            return []
        escaped = text.replace(" ", SPM_SPACE)
        data = ((SPM_SPACE if add_prefix else "") + escaped).encode("utf-8")
        out = np.empty(len(data), dtype=np.int32)
        n = encode_text(tables.handle, data, len(data), unk_id, out.ctypes.data)
        if n < 0:
            raise MemoryError("tokenizing ran out of memory")
        return out[:n].tolist()

    return MergingBackend(vocab, tables, encode, batch_backend)
