"""Text <-> token ids, built from tokenizer.json or from GGUF `tokenizer.ggml.*` metadata.

The `tokenizers` library does the encoding. A GGUF-built tokenizer reproduces llama.cpp:
SentencePiece BPE ("llama") gets merges derived from the token scores, and byte-level BPE
("gpt2") gets the split regexes llama.cpp uses for its `tokenizer.ggml.pre`. Decoding is done
here, from each token's bytes, so that a stream of pieces concatenates to exactly the full
decode and never ends inside a UTF-8 character. No torch here.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun.errors import TokenizerError, UnsupportedError

SPM_SPACE = "\u2581"

# llama.cpp's split regexes per `tokenizer.ggml.pre` (llama-vocab.cpp), applied in sequence.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}
# llama.cpp adds BOS for these pre-tokenizers when the file does not say; SentencePiece always.
_PRE_ADDS_BOS = frozenset({"llama-bpe", "llama3", "llama-v3"})
# and matches whole words against the vocabulary before merging for these.
_PRE_IGNORES_MERGES = _PRE_ADDS_BOS

# Token texts llama.cpp treats as end of generation (and as control tokens) in any vocabulary.
_END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)

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
        if model not in ("llama", "gpt2"):
            if model is None:
                raise TokenizerError(f"{source}: no {Keys.Tokenizer.MODEL} in the metadata")
            raise UnsupportedError(
                f"{source}: {Keys.Tokenizer.MODEL} {model!r} is not supported "
                "(supported: 'llama', 'gpt2')"
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
        eog = [token_id(k) for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID)]
        eog += [token_id(Keys.Tokenizer.EOM_ID)]
        vocab = _gguf_vocab(tokens)
        eog += [vocab.get(t) for t in _END_OF_GENERATION]
        eog_ids = {i for i in eog if i is not None}
        kinds = _ids_by_type(types)
        # llama.cpp turns every end-of-generation token into a control token.
        special_ids = kinds[TokenType.CONTROL] | kinds[TokenType.UNKNOWN] | eog_ids
        user_ids = kinds[TokenType.USER_DEFINED] - special_ids

        if spm:
            scores = _gguf_array(metadata, Keys.Tokenizer.SCORES, n, source, 0.0)
            unk = token_id(Keys.Tokenizer.UNK_ID, 0)
            bpe = BPE(
                vocab,
                _spm_merges(vocab, scores),
                unk_token=tokens[unk] if unk is not None and tokens[unk] in vocab else None,
                byte_fallback=True,
            )
            add_prefix = bool(metadata.get(Keys.Tokenizer.ADD_PREFIX, True))
            backend = Backend(bpe)
            escape = normalizers.Replace(" ", SPM_SPACE)
            # llama.cpp adds the space prefix to every run of text, also after a special token.
            backend.normalizer = (
                normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape])
                if add_prefix
                else escape
            )
            add_bos_default = True
            bos, eos = token_id(Keys.Tokenizer.BOS_ID, 1), token_id(Keys.Tokenizer.EOS_ID, 2)
        else:
            pre = metadata.get(Keys.Tokenizer.PRE, "default")
            if pre not in _PRE_SPLITS:
                raise UnsupportedError(
                    f"{source}: pre-tokenizer {Keys.Tokenizer.PRE} = {pre!r} is not supported "
                    f"(supported: {', '.join(sorted(_PRE_SPLITS))})"
                )
            merges = metadata.get(Keys.Tokenizer.MERGES)
            if not isinstance(merges, list):
                raise TokenizerError(f"{source}: no {Keys.Tokenizer.MERGES} in the metadata")
            try:
                bpe = BPE(vocab, _split_merges(merges), ignore_merges=pre in _PRE_IGNORES_MERGES)
            except Exception as e:
                raise TokenizerError(
                    f"{source}: {Keys.Tokenizer.MERGES} does not fit {Keys.Tokenizer.LIST}: {e}"
                ) from None
            backend = Backend(bpe)
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), "isolated") for r in _PRE_SPLITS[pre]]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
            add_prefix = False
            add_bos_default = pre in _PRE_ADDS_BOS
            bos, eos = token_id(Keys.Tokenizer.BOS_ID), token_id(Keys.Tokenizer.EOS_ID)

        rstrip = _rstrip_after(metadata, tokens, special_ids | user_ids)
        backend.add_tokens(
            [
                AddedToken(
                    tokens[i], special=i in special_ids, normalized=False, rstrip=i in rstrip
                )
                for i in sorted(special_ids | user_ids)
                if tokens[i] in vocab
            ]
        )
        verbatim = special_ids | user_ids | kinds[TokenType.UNUSED]

        def spell(i: int) -> bytes:
            if i in verbatim:
                # llama.cpp prints nothing for unused tokens.
                return b"" if types[i] == TokenType.UNUSED else _raw(tokens[i])
            if spm:
                return _spm_bytes(tokens[i], types[i] == TokenType.BYTE)
            return _byte_level_bytes(tokens[i])

        return cls(
            backend,
            spell,
            vocab_size=n,
            bos_id=bos,
            eos_id=eos,
            add_bos=bool(metadata.get(Keys.Tokenizer.ADD_BOS, add_bos_default)),
            add_eos=bool(metadata.get(Keys.Tokenizer.ADD_EOS, False)),
            special_ids=special_ids,
            eog_ids=eog_ids,
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


def _ids_by_type(types: list[int]) -> dict[TokenType, set[int]]:
    """The ids of each token type but NORMAL, which is nearly all of them."""
    kinds: dict[TokenType, set[int]] = {t: set() for t in TokenType}
    normal = int(TokenType.NORMAL)
    for i in [i for i, t in enumerate(types) if t != normal]:
        if types[i] in kinds:
            kinds[types[i]].add(i)
    return kinds


def _spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges for SentencePiece BPE, which stores scores instead.

    llama.cpp merges the adjacent pair whose joined token scores highest, leftmost first on a
    tie. Ranking every split of every token by that token's score gives the same order; among
    equal scores (Llama's runs of spaces) longer tokens and longer left parts rank first, which
    reproduces the leftmost-first growth of a run.
    """
    found = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], -len(token), -cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """Cut each merge "a b" at the first space after its first character, as llama.cpp does."""
    # Byte-level tokens hold no spaces, so splitting the joined list at once is the fast path.
    parts = " ".join(merges).split(" ")
    if len(parts) != 2 * len(merges):
        return [(m[: (cut := m.find(" ", 1))], m[cut + 1 :]) for m in merges]
    return list(zip(parts[::2], parts[1::2], strict=True))


def _rstrip_after(metadata: dict[str, Any], tokens: list[str], ids: set[int]) -> set[int]:
    """Special tokens that swallow the whitespace after them: llama.cpp does this for Phi-3,
    recognised by its general.name, as Phi-3's own tokenizer.json does."""
    name = str(metadata.get(Keys.General.NAME, "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    return {i for i in ids if tokens[i] not in keep}


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
