"""Text <-> token ids, built from tokenizer.json or from GGUF `tokenizer.ggml.*` metadata.

The `tokenizers` library does the encoding. A GGUF-built tokenizer reproduces llama.cpp:
SentencePiece BPE ("llama") gets merges derived from the token scores, and BPE ("gpt2",
"gemma4") gets the split regexes and flags llama.cpp uses for its `tokenizer.ggml.pre`
(llmrun.pretokenizers). Decoding is done here, from each token's bytes, so that a stream of
pieces concatenates to exactly the full decode and never ends inside a UTF-8 character. No torch
here.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys, TokenType
from tokenizers import AddedToken, normalizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.pretokenizers import PRE_TOKENIZERS, SPM_SPACE, PreTokenizer, pre_tokenizer

# Token texts llama.cpp treats as end of generation (and as control tokens) in any vocabulary.
_END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's
    "[e~[",
)
# Fill-in-the-middle tokens, found by their text where the file names none: llama.cpp makes
# them control tokens, and the pad, repo and file-separator ones end generation.
_FIM_TEXTS = {
    Keys.Tokenizer.FIM_PRE_ID: (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>",
        "\u2581<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    Keys.Tokenizer.FIM_SUF_ID: (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>",
        "\u2581<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    Keys.Tokenizer.FIM_MID_ID: (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<\uff5cfim\u2581end\uff5c>",
        "<MID>",
        "\u2581<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    Keys.Tokenizer.FIM_PAD_ID: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    Keys.Tokenizer.FIM_REP_ID: (
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ),
    Keys.Tokenizer.FIM_SEP_ID: ("<|file_sep|>",),
}
_FIM_ENDS = (Keys.Tokenizer.FIM_PAD_ID, Keys.Tokenizer.FIM_REP_ID, Keys.Tokenizer.FIM_SEP_ID)
_FIM_OLD_KEYS = {  # the names older files use
    Keys.Tokenizer.FIM_PRE_ID: Keys.Tokenizer.PREFIX_ID,
    Keys.Tokenizer.FIM_SUF_ID: Keys.Tokenizer.SUFFIX_ID,
    Keys.Tokenizer.FIM_MID_ID: Keys.Tokenizer.MIDDLE_ID,
}
# gpt-oss: llama.cpp always matches and prints these, even where the file calls them control.
_ALWAYS_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_GGUF_MODELS = ("llama", "gpt2", "gemma4")
_BATCH = 4096  # texts per call of the tokenizers library's encode_batch

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(shifted))
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_chars()


def _byte_level_bytes(text: str) -> bytes:
    # A token with characters outside the alphabet (an added token kept as plain text) is
    # literal, as in the ByteLevel decoder of `tokenizers`.
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in text)
    except KeyError:
        return _raw(text)


def _raw(text: str) -> bytes:
    # gguf_io keeps tokens that are not valid UTF-8 as surrogate escapes.
    return text.encode("utf-8", "surrogateescape")


def _spm_bytes(text: str, byte_fallback: bool) -> bytes:
    if byte_fallback and (m := _BYTE_TOKEN.fullmatch(text)):
        return bytes([int(m.group(1), 16)])
    return _raw(text.replace(SPM_SPACE, " "))


class Tokenizer:
    """Encodes text to token ids and decodes them back, the same way for every source."""

    def __init__(
        self,
        backend: Backend,
        spell: Callable[[int], bytes],
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        special_ids: Iterable[int],
        eog_ids: Iterable[int],
        strip_leading_space: bool,
        source: str,
    ) -> None:
        self._backend = backend
        self._spell = spell
        self._bytes: list[bytes | None] = [None] * vocab_size
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.special_ids = frozenset(special_ids)
        self.eog_ids = frozenset(eog_ids)
        self.strip_leading_space = strip_leading_space
        self.source = source

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`; BOS as the model says unless `add_bos`, and never twice.

        `parse_special=False` reads control tokens such as "<|im_end|>" as plain text;
        user-defined tokens are matched either way, as llama.cpp does.
        """
        self._backend.encode_special_tokens = not parse_special
        ids = self._backend.encode(text, add_special_tokens=False).ids
        wants_bos = self.add_bos if add_bos is None else add_bos
        if wants_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def encode_batch(
        self,
        texts: Sequence[str],
        add_bos: bool | None = None,
        parse_special: bool = True,
        threads: int | None = None,
    ) -> list[list[int]]:
        """`encode` of each text, on the `tokenizers` library's threads (`threads` of them).

        The library sizes its thread pool once per process, at its first parallel encode, so
        a `threads` given later than that is not honoured, except 1 (no pool at all).
        """
        self._backend.encode_special_tokens = not parse_special
        texts = list(texts)
        out: list[list[int]] = []
        with _thread_pool(threads):
            # In chunks: the library's Encoding objects hold each token's text and offsets too.
            for start in range(0, len(texts), _BATCH):
                chunk = texts[start : start + _BATCH]
                encodings = self._backend.encode_batch_fast(chunk, add_special_tokens=False)
                out += [e.ids for e in encodings]
        wants_bos = self.add_bos if add_bos is None else add_bos
        if wants_bos and self.bos_id is not None:
            for ids in out:
                if ids[:1] != [self.bos_id]:
                    ids.insert(0, self.bos_id)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary decode to nothing, like in `tokenizers`."""
        data = b"".join(self._piece(i, skip_special) for i in ids)
        if self.strip_leading_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def stream(self, skip_special: bool = True, *, after: Iterable[int] = ()) -> StreamDecoder:
        """An incremental decoder. `after` holds ids whose text was already shown (a prompt):
        the stream continues them, so a leading space that decode() would strip is kept."""
        decoder = StreamDecoder(self, skip_special)
        for token_id in after:
            decoder.add(token_id)
        return decoder

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (one byte for a byte-fallback token)."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(
                f"{self.source}: token id {token_id} is outside the vocabulary "
                f"of {self.vocab_size} tokens"
            )
        piece = self._bytes[token_id]
        if piece is None:
            piece = self._bytes[token_id] = self._spell(token_id)
        return piece

    def token_to_piece(self, token_id: int) -> str:
        """What llama.cpp's llama-tokenize prints for the id (control tokens as their text)."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def token_id(self, text: str) -> int | None:
        """The id of a token stored exactly as `text`, such as "<|im_end|>"; None if none."""
        return self._backend.token_to_id(text)

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        if (skip_special and token_id in self.special_ids) or not (0 <= token_id < self.vocab_size):
            return b""
        return self.token_bytes(token_id)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], source: str) -> Tokenizer:
        """Build from GGUF metadata as llama.cpp reads it; `source` names the file in errors."""
        model = metadata.get(Keys.Tokenizer.MODEL)
        if model not in _GGUF_MODELS:
            if model is None:
                raise TokenizerError(f"{source}: no {Keys.Tokenizer.MODEL} in the metadata")
            raise UnsupportedError(
                f"{source}: {Keys.Tokenizer.MODEL} {model!r} is not supported "
                f"(supported: {', '.join(map(repr, _GGUF_MODELS))})"
            )
        tokens = metadata.get(Keys.Tokenizer.LIST)
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError(f"{source}: no {Keys.Tokenizer.LIST} in the metadata")
        n = len(tokens)
        types = _gguf_array(metadata, Keys.Tokenizer.TOKEN_TYPE, n, source, TokenType.NORMAL)

        def token_id(key: str, default: int | None = None) -> int | None:
            value = metadata.get(key, default)
            # Files write 0xFFFFFFFF (or any id past the end) for "no such token".
            return value if isinstance(value, int) and 0 <= value < n else None

        spm = model == "llama"
        vocab = _gguf_vocab(tokens)
        if spm:
            pre = None
            add_prefix = bool(metadata.get(Keys.Tokenizer.ADD_PREFIX, True))
            backend = _spm_backend(metadata, tokens, vocab, n, source, add_prefix)
            add_bos_default = True
            bos, eos = token_id(Keys.Tokenizer.BOS_ID, 1), token_id(Keys.Tokenizer.EOS_ID, 2)
        else:
            # llama.cpp reads no tokenizer.ggml.pre for Gemma 4's own tokenizer model, and takes
            # a missing or empty one for "default".
            name = "gemma4" if model == "gemma4" else metadata.get(Keys.Tokenizer.PRE) or "default"
            pre = PRE_TOKENIZERS.get(name)
            if pre is None:
                raise UnsupportedError(
                    f"{source}: pre-tokenizer {Keys.Tokenizer.PRE} = {name!r} is not supported "
                    f"(llmrun knows the {len(PRE_TOKENIZERS)} values llama.cpp knows for BPE, "
                    "as of llama-cpp-python 0.3.36; they are listed in llmrun/pretokenizers.py)"
                )
            add_prefix = False
            backend = _bpe_backend(metadata, vocab, pre, source)
            add_bos_default = pre.add_bos
            bos, eos = token_id(Keys.Tokenizer.BOS_ID), token_id(Keys.Tokenizer.EOS_ID)

        marks = _Marks.from_gguf(metadata, tokens, types, vocab, token_id, bos, eos)
        backend.add_tokens(
            [
                AddedToken(
                    tokens[i],
                    special=i in marks.special,
                    normalized=False,
                    lstrip=i in marks.lstrip,
                    rstrip=i in marks.rstrip,
                )
                for i in sorted(marks.special | marks.user)
                if tokens[i] in vocab
            ]
        )
        verbatim = marks.special | marks.user | marks.unused
        byte_level = pre is not None and pre.byte_level

        def spell(i: int) -> bytes:
            if i in verbatim:
                # llama.cpp prints nothing for unused tokens.
                return b"" if i in marks.unused else _raw(tokens[i])
            if byte_level:
                return _byte_level_bytes(tokens[i])
            return _spm_bytes(tokens[i], types[i] == TokenType.BYTE)

        add_bos = bool(metadata.get(Keys.Tokenizer.ADD_BOS, add_bos_default))
        add_bos |= pre is not None and pre.bos_always
        return cls(
            backend,
            spell,
            vocab_size=n,
            bos_id=bos,
            eos_id=eos,
            add_bos=add_bos,
            add_eos=bool(metadata.get(Keys.Tokenizer.ADD_EOS, False)),
            special_ids=marks.special,
            eog_ids=marks.eog,
            strip_leading_space=spm and add_prefix,
            source=source,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from tokenizer.json, with BOS/EOS from tokenizer_config.json when present."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json (a model directory needs one)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:
            raise TokenizerError(f"{file}: cannot be read by the tokenizers library: {e}") from None
        config = _read_json(path / "tokenizer_config.json")

        def config_token(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        added = backend.get_added_tokens_decoder()
        special_ids = {i for i, t in added.items() if t.special}
        bos, eos = config_token("bos_token"), config_token("eos_token")
        template_first = _template_first_special(backend)
        if bos is None:
            bos = template_first
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = template_first is not None and template_first == bos
        eog_ids = {i for i, t in added.items() if t.content in _END_OF_GENERATION}
        eog_ids |= {eos} if eos is not None else set()

        decoder = _decoder_parts(backend, file)
        strip = False
        if "ByteLevel" in decoder:
            spell_model: Callable[[str], bytes] = _byte_level_bytes
        elif "Metaspace" in decoder or "Replace" in decoder:
            fallback = "ByteFallback" in decoder
            metaspace = decoder.get("Metaspace", {})
            strip = metaspace.get("prepend_scheme", "never") != "never" or bool(
                metaspace.get("add_prefix_space")
            )
            strip |= decoder.get("Strip", {}).get("start", 0) > 0

            def spell_model(text: str) -> bytes:
                return _spm_bytes(text, fallback)
        else:
            raise UnsupportedError(
                f"{file}: decoder {sorted(decoder) or 'none'} is not supported "
                "(supported: ByteLevel, Metaspace, or Replace \u2581 with ByteFallback)"
            )

        def spell(i: int) -> bytes:
            if i in added:
                return _raw(added[i].content)
            text = backend.id_to_token(i)
            return b"" if text is None else spell_model(text)

        return cls(
            backend,
            spell,
            vocab_size=max(
                backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1
            ),
            bos_id=bos,
            eos_id=eos,
            add_bos=add_bos,
            add_eos=bool(config.get("add_eos_token", False)),
            special_ids=special_ids,
            eog_ids=eog_ids,
            strip_leading_space=strip,
            source=str(file),
        )


class StreamDecoder:
    """Turns ids into text one at a time, holding back bytes of an unfinished character.

    The pieces returned by `add` and `flush` concatenate to exactly `Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._strip = tokenizer.strip_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        """Text that `token_id` completes; may be empty while a character is unfinished."""
        data = self._tokenizer._piece(token_id, self._skip_special)
        if self._strip and data:
            self._strip = False
            if data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is held back (an unfinished character decodes to U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer from a GGUF file, a model directory, or a tokenizer.json file."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.name == "tokenizer.json" and path.is_file():
        return Tokenizer.from_hf_dir(path.parent)
    if not path.is_file():
        raise TokenizerError(f"{path}: no such file or directory")
    # Imported here: the llmrun.loading package imports torch, which tokenizing never needs.
    from llmrun.loading.gguf_io import read_gguf

    return Tokenizer.from_gguf_metadata(read_gguf(path, with_tensors=False).metadata, str(path))


def _gguf_array(metadata: dict[str, Any], key: str, n: int, source: str, default: Any) -> list:
    values = metadata.get(key)
    if values is None:
        return [default] * n
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise TokenizerError(f"{source}: {key} has {got} entries, but there are {n} tokens")
    return values


def _gguf_vocab(tokens: list[str]) -> dict[str, int]:
    """Token text -> id, the later id winning as in llama.cpp, without tokens no text can match
    (empty ones, and ones that are not valid UTF-8, which `tokenizers` cannot hold)."""
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    vocab.pop("", None)
    try:
        "".join(tokens).encode("utf-8")
    except UnicodeEncodeError:
        for t in [t for t in vocab if not _is_utf8(t)]:
            del vocab[t]
    return vocab


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _spm_backend(
    metadata: dict[str, Any],
    tokens: list[str],
    vocab: dict[str, int],
    n: int,
    source: str,
    add_prefix: bool,
) -> Backend:
    scores = _gguf_array(metadata, Keys.Tokenizer.SCORES, n, source, 0.0)
    unk = metadata.get(Keys.Tokenizer.UNK_ID, 0)
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < n else None
    bpe = BPE(
        vocab,
        _spm_merges(vocab, scores),
        unk_token=unk_token if unk_token in vocab else None,
        byte_fallback=True,
    )
    backend = Backend(bpe)
    escape = normalizers.Replace(" ", SPM_SPACE)
    # llama.cpp adds the space prefix to every run of text, also after a special token.
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape]) if add_prefix else escape
    )
    return backend


def _bpe_backend(
    metadata: dict[str, Any], vocab: dict[str, int], pre: PreTokenizer, source: str
) -> Backend:
    merges = metadata.get(Keys.Tokenizer.MERGES)
    if not isinstance(merges, list):
        raise TokenizerError(f"{source}: no {Keys.Tokenizer.MERGES} in the metadata")
    try:
        bpe = BPE(
            vocab,
            _split_merges(merges),
            ignore_merges=pre.ignore_merges,
            # Without GPT-2's byte alphabet, a character outside the vocabulary is spelled
            # with <0xXX> byte tokens.
            byte_fallback=not pre.byte_level,
        )
    except Exception as e:
        raise TokenizerError(
            f"{source}: {Keys.Tokenizer.MERGES} does not fit {Keys.Tokenizer.LIST}: {e}"
        ) from None
    backend = Backend(bpe)
    if pre.escape_spaces:
        backend.normalizer = normalizers.Replace(" ", SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizer(pre)
    return backend


@dataclass
class _Marks:
    """Token ids by the part llama.cpp gives them beyond plain text."""

    special: set[int]  # control and unknown: parsed only when asked, skipped in decode
    user: set[int]  # user-defined: always matched, always printed
    unused: set[int]  # printed as nothing
    eog: set[int]  # end generation
    lstrip: set[int]  # swallow the whitespace before them
    rstrip: set[int]  # and after them

    @classmethod
    def from_gguf(
        cls,
        metadata: dict[str, Any],
        tokens: list[str],
        types: list[int],
        vocab: dict[str, int],
        token_id: Callable[[str], int | None],
        bos: int | None,
        eos: int | None,
    ) -> _Marks:
        """As llama_vocab::impl::load marks them: the file's token types, then its fixes."""
        kinds: dict[int, set[int]] = {int(t): set() for t in TokenType}
        normal = int(TokenType.NORMAL)
        for i in [i for i, t in enumerate(types) if t != normal]:
            if types[i] in kinds:
                kinds[types[i]].add(i)
        control = kinds[TokenType.CONTROL] | kinds[TokenType.UNKNOWN]
        user = kinds[TokenType.USER_DEFINED]
        eog = {i for i in (eos, token_id(Keys.Tokenizer.EOT_ID), token_id(Keys.Tokenizer.EOM_ID))}
        for key, texts in _FIM_TEXTS.items():
            fim = token_id(key)
            if fim is None and key in _FIM_OLD_KEYS:
                fim = token_id(_FIM_OLD_KEYS[key])
            if fim is None:
                fim = next((vocab[t] for t in texts if t in vocab), None)
                control |= {fim} if fim is not None else set()
            if key in _FIM_ENDS:
                eog.add(fim)
        ends = {vocab[t] for t in _END_OF_GENERATION if t in vocab}
        control |= ends
        eog |= ends
        eog.discard(None)
        shown = {vocab[t] for t in _ALWAYS_SHOWN if t in vocab}
        control -= shown
        user |= shown
        text = {i: tokens[i] for i in eog}
        # gpt-oss (and Solar Open): <|end|> ends a message, not the generation.
        if "<|end|>" in text.values() and (
            {"<|return|>", "<|call|>"} <= set(text.values())
            or {"<|calls|>", "<|flush|>"} <= set(text.values())
        ):
            end = next(i for i, t in text.items() if t == "<|end|>")
            eog.discard(end)
            control.discard(end)
            user.add(end)
        # Gemma 4 (and PLaMo 2): </s> is a plain token.
        if "</s>" in text.values() and {"<|tool_response>", "<|plamo:eos|>"} & set(text.values()):
            plain = next(i for i, t in text.items() if t == "</s>")
            eog.discard(plain)
            control.discard(plain)
            user.discard(plain)
        user -= control
        lstrip, rstrip = _stripped(metadata, vocab, control | user)
        return cls(control, user, kinds[TokenType.UNUSED] - control - user, eog, lstrip, rstrip)


def _stripped(
    metadata: dict[str, Any], vocab: dict[str, int], ids: set[int]
) -> tuple[set[int], set[int]]:
    """Special tokens that swallow the whitespace before or after them: llama.cpp sets this by
    model, recognised by pre-tokenizer, architecture or general.name, as their tokenizer.json
    files do."""
    pre = str(metadata.get(Keys.Tokenizer.PRE, ""))
    arch = str(metadata.get(Keys.General.ARCHITECTURE, ""))
    name = str(metadata.get(Keys.General.NAME, "")).lower()

    def ids_of(*texts: str) -> set[int]:
        return {vocab[t] for t in texts if t in vocab and vocab[t] in ids}

    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
    ):
        return ids_of("<mask>"), set()
    if "phi-3" in name or "phi3" in name:
        return set(), ids - ids_of("<unk>", "<s>", "<|endoftext|>")
    if "modern-bert" in name:
        return ids_of("[MASK]"), set()
    return set(), set()


_pool = {"started": False}


@contextlib.contextmanager
def _thread_pool(threads: int | None) -> Iterator[None]:
    """Runs a batch on `threads` of the tokenizers library's threads (None: its default).

    The library reads TOKENIZERS_PARALLELISM at every call (while it is "false", no thread
    pool is used or started) and RAYON_NUM_THREADS once, when it starts its pool.
    """
    if threads is not None and threads < 1:
        raise TokenizerError(f"threads must be at least 1, got {threads}")
    if threads == 1:
        with _environ("TOKENIZERS_PARALLELISM", "false"):
            yield
        return
    starts = not _pool["started"]
    _pool["started"] = True
    with _environ("RAYON_NUM_THREADS", str(threads) if starts and threads else None):
        yield


@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (None: left as it is) for the block."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and saved is None:
            del os.environ[name]
        elif value is not None:
            os.environ[name] = saved


def _spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges for SentencePiece BPE, which stores scores instead.

    llama.cpp merges the adjacent pair whose joined token scores highest, leftmost first on a
    tie. Ranking every split of every token by that token's score gives the same order; among
    equal scores (Llama's runs of spaces) longer tokens and longer left parts rank first, which
    reproduces the leftmost-first growth of a run.
    """
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


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """Cut each merge "a b" at the first space after its first character, as llama.cpp does; a
    merge without one can never apply there, and is left out."""
    # Byte-level tokens hold no spaces, so splitting the joined list at once is the fast path.
    parts = " ".join(merges).split(" ")
    if (
        len(parts) == 2 * len(merges)
        and "" not in parts
        and all(map(str.__contains__, merges, itertools.repeat(" ")))
    ):
        pairs = iter(parts)  # every merge has one space
        return list(zip(pairs, pairs, strict=False))
    cuts = ((m, m.find(" ", 1)) for m in merges)
    return [(m[:cut], m[cut + 1 :]) for m, cut in cuts if cut > 0]


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{file}: cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return data


def _component(obj: Any) -> dict[str, Any]:
    # tokenizers' components pickle to their tokenizer.json form.
    return json.loads(obj.__getstate__()) if obj is not None else {}


def _decoder_parts(backend: Backend, file: Path) -> dict[str, dict[str, Any]]:
    """The decoder's steps by type: {"ByteLevel": {...}} or {"Replace": ..., "Strip": ...}."""
    decoder = _component(backend.decoder)
    steps = decoder.get("decoders", [decoder]) if decoder else []
    for step in steps:
        if step.get("type") == "Replace" and (
            step.get("pattern") != {"String": SPM_SPACE} or step.get("content") != " "
        ):
            raise UnsupportedError(
                f"{file}: decoder Replace {step.get('pattern')} -> {step.get('content')!r} "
                f"is not supported (only {SPM_SPACE} -> ' ')"
            )
    return {s["type"]: s for s in steps if "type" in s}


def _template_first_special(backend: Backend) -> int | None:
    """The id a TemplateProcessing post-processor puts before the text, if any (e.g. BOS)."""
    processor = _component(backend.post_processor)
    for step in processor.get("processors", [processor]):
        if step.get("type") != "TemplateProcessing":
            continue
        single = step.get("single") or [{}]
        first = single[0].get("SpecialToken")
        if first is not None:
            ids = step.get("special_tokens", {}).get(first.get("id"), {}).get("ids") or [None]
            return ids[0]
    return None
