"""A SentencePiece model file (the protobuf ModelProto) read into the GGUF tokenizer
metadata llama.cpp's converter writes for it, so a model folder without tokenizer.json
(Llama 2-era fine-tunes, ERNIE 4.5; T5-style Unigram ones) tokenizes as its GGUF would
(llmrun.tokenizer_gguf). The file is `tokenizer.model`, or, in older uploads, the vocab file
of the transformers tokenizer the folder was made for: T5Tokenizer's `spiece.model`,
XLMRobertaTokenizer's `sentencepiece.bpe.model` (multilingual-e5, bge-m3); each of those
two gets that tokenizer's ids.

The protobuf is read here, field by field, with no protobuf library and nothing executed:
ModelProto's pieces (1: piece 1, score 2, type 3), trainer_spec (2: model_type 3,
unk/bos/eos ids 40-42) and normalizer_spec (3: precompiled_charsmap 2, add_dummy_prefix 3,
remove_extra_whitespaces 4), as sentencepiece_model.proto numbers them.

A BPE model's vocabulary is the converter's (conversion/base.py,
_create_vocab_sentencepiece): the pieces with their scores and types (user-defined pieces
as normal ones, as it writes them), then added_tokens.json and tokenizer_config.json's
added_tokens_decoder over them, padded with [PADn] to config.json's vocab_size.

A Unigram model's is T5's (conversion/t5.py, T5Model.set_vocab: tokenizer model "t5",
llama.cpp's UGM, llmrun.unigram): the same pieces, padded with [PADn] unused tokens to
config.json's vocab_size, added_tokens.json over them, the normalizer spec as it is; the
special ids are config.json's `*_token_id` (what gguf-py's SpecialVocab reads of a folder
without tokenizer.json), else the model's own, and add_bos_token / add_eos_token from
tokenizer_config.json. A `spiece.model` adds T5Tokenizer's sentinels after the pieces,
<extra_id_0> last (tokenizer_config.json's extra_ids of them, else 100), which the converter
leaves [PADn] fillers. A `sentencepiece.bpe.model` is laid out as XLMRobertaTokenizer lays it
(fairseq's): <s> <pad> </s> <unk> as 0-3, every other piece one id later, <mask> after them,
<s> ... </s> around a sequence; the converter (conversion/bert.py, _xlmroberta_set_vocab)
moves the pieces alike but leaves <mask> a filler and writes no unknown id (llama.cpp then
takes 2, </s>). No torch here.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import Keys, TokenType

from llmrun.errors import TokenizerError, UnsupportedError

# sentencepiece_model.proto: TrainerSpec.ModelType and SentencePiece.Type.
UNIGRAM, BPE = 1, 2
_MODEL_TYPES = {1: "Unigram", 2: "BPE", 3: "Word", 4: "Char"}
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_TYPES = {
    _NORMAL: TokenType.NORMAL,
    _UNKNOWN: TokenType.UNKNOWN,
    _CONTROL: TokenType.CONTROL,
    _USER_DEFINED: TokenType.NORMAL,  # the converter asks sentencepiece for no other kind
    _UNUSED: TokenType.UNUSED,
    _BYTE: TokenType.BYTE,
}
ADDED_SCORE = -1000.0  # the converter's score for added and padding tokens
UNSET_SCORE = -10000.0
T5_FILE, XLMR_FILE = "spiece.model", "sentencepiece.bpe.model"
# A folder's SentencePiece model files, in the order they are looked for.
FILES = ("tokenizer.model", T5_FILE, XLMR_FILE)
T5_EXTRA_IDS = 100  # T5Tokenizer's default number of sentinels
MAX_EXTRA_IDS = 1 << 16
# XLMRobertaTokenizer's (fairseq's) ids 0-2, <unk> being 3; they take the place of
# SentencePiece's own unk, bos and eos (0-2).
XLMR_CONTROL = ("<s>", "<pad>", "</s>")


@dataclass
class SentencePieceModel:
    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # piece, score, type
    model_type: int = 1  # Unigram, the proto's default
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    precompiled_charsmap: bytes = b""


class _Reader:
    """Protobuf wire format: (field number, wire type, value) of one message."""

    def __init__(self, data: bytes, source: str) -> None:
        self.data, self.pos, self.source = data, 0, source

    def fields(self):
        while self.pos < len(self.data):
            key = self._varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                yield number, self._varint()
            elif wire == 1:
                yield number, self._take(8)
            elif wire == 2:
                yield number, self._take(self._varint())
            elif wire == 5:
                yield number, self._take(4)
            else:
                self._fail(f"wire type {wire}")

    def _varint(self) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                self._fail("a cut varint")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            self._fail("a field longer than the file")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def _fail(self, what: str) -> None:
        raise TokenizerError(f"{self.source}: not a SentencePiece model ({what})")


def _int32(value: int) -> int:
    """A varint of an int32 field (negative ones are written in 64 bits)."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _float(value: Any, reader: _Reader) -> float:
    if not isinstance(value, bytes) or len(value) != 4:
        reader._fail("a score that is not a float")
    return struct.unpack("<f", value)[0]


def read_model(data: bytes, source: str) -> SentencePieceModel:
    """The parts of a tokenizer.model that tokenizing reads."""
    model = SentencePieceModel()
    top = _Reader(data, source)
    for number, value in top.fields():
        if number == 1 and isinstance(value, bytes):
            piece, score, kind = None, 0.0, _NORMAL
            inner = _Reader(value, source)
            for n, v in inner.fields():
                if n == 1 and isinstance(v, bytes):
                    piece = v.decode("utf-8", errors="replace")
                elif n == 2:
                    score = _float(v, inner)
                elif n == 3 and isinstance(v, int):
                    kind = v
            if piece is None:
                top._fail("a piece without its text")
            model.pieces.append((piece, score, kind))
        elif number == 2 and isinstance(value, bytes):
            for n, v in _Reader(value, source).fields():
                if isinstance(v, int):
                    if n == 3:
                        model.model_type = v
                    elif n in (40, 41, 42):
                        setattr(model, {40: "unk_id", 41: "bos_id", 42: "eos_id"}[n], _int32(v))
        elif number == 3 and isinstance(value, bytes):
            for n, v in _Reader(value, source).fields():
                if n == 2 and isinstance(v, bytes):
                    model.precompiled_charsmap = v
                elif n == 3 and isinstance(v, int):
                    model.add_dummy_prefix = bool(v)
                elif n == 4 and isinstance(v, int):
                    model.remove_extra_whitespaces = bool(v)
    if not model.pieces:
        top._fail("no pieces")
    return model


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def gguf_metadata(file: Path) -> dict[str, Any]:
    """The `tokenizer.ggml.*` metadata llama.cpp's converter writes for a folder's
    SentencePiece model file, one of FILES (with its added tokens and tokenizer_config.json's
    settings; the module's docstring)."""
    folder, source = file.parent, str(file)
    try:
        model = read_model(file.read_bytes(), source)
    except OSError as e:
        raise TokenizerError(f"{file}: {e.strerror or e}") from None
    config = _read_json(folder / "config.json")
    config = config if isinstance(config, dict) else {}
    if model.model_type == UNIGRAM:
        return _unigram_metadata(file, model, config)
    if model.model_type != BPE:
        kind = _MODEL_TYPES.get(model.model_type, str(model.model_type))
        raise UnsupportedError(
            f"{file}: a SentencePiece {kind} model is not supported (llmrun reads BPE and "
            "Unigram ones, as llama.cpp's SentencePiece and UGM tokenizers compute)"
        )
    if file.name != "tokenizer.model":
        raise UnsupportedError(
            f"{file}: a SentencePiece BPE model is supported as tokenizer.model only "
            f"(llama.cpp's converter reads {file.name} as a Unigram model)"
        )
    size = config.get("vocab_size")
    if not isinstance(size, int) or size < 1:
        size = len(model.pieces)
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [UNSET_SCORE] * size
    types = [TokenType.UNUSED] * size
    for i, (piece, score, kind) in enumerate(model.pieces[:size]):
        tokens[i], scores[i], types[i] = piece, score, _TYPES.get(kind, TokenType.NORMAL)
    added = _read_json(folder / "added_tokens.json")
    for text, i in added.items() if isinstance(added, dict) else ():
        if isinstance(i, int) and 0 <= i < size:
            tokens[i], scores[i], types[i] = text, ADDED_SCORE, TokenType.USER_DEFINED
    settings = _read_json(folder / "tokenizer_config.json")
    settings = settings if isinstance(settings, dict) else {}
    decoder = settings.get("added_tokens_decoder")
    for key, token in decoder.items() if isinstance(decoder, dict) else ():
        if not (str(key).isdigit() and int(key) < size and isinstance(token, dict)):
            continue
        text = token.get("content")
        if not isinstance(text, str):
            continue
        i = int(key)
        if token.get("special") or _looks_special(text):
            types[i] = TokenType.CONTROL
        else:
            text, types[i] = text.replace("\u2581", " "), TokenType.USER_DEFINED
        tokens[i], scores[i] = text, ADDED_SCORE

    def settings_id(name: str, default: int) -> int:
        value = settings.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value in tokens:
            return tokens.index(value)
        return default

    metadata: dict[str, Any] = {
        Keys.Tokenizer.MODEL: "llama",
        Keys.Tokenizer.PRE: "default",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.SCORES: scores,
        Keys.Tokenizer.TOKEN_TYPE: types,
        Keys.Tokenizer.ADD_PREFIX: model.add_dummy_prefix,
        Keys.Tokenizer.UNK_ID: model.unk_id,
        Keys.Tokenizer.BOS_ID: settings_id("bos_token", model.bos_id),
        Keys.Tokenizer.EOS_ID: settings_id("eos_token", model.eos_id),
    }
    for name, key in (
        ("add_bos_token", Keys.Tokenizer.ADD_BOS),
        ("add_eos_token", Keys.Tokenizer.ADD_EOS),
    ):
        if isinstance(settings.get(name), bool):
            metadata[key] = settings[name]
    return metadata


def _unigram_metadata(
    file: Path, model: SentencePieceModel, config: dict[str, Any]
) -> dict[str, Any]:
    """The "t5" metadata of a Unigram model (the module's docstring)."""
    folder = file.parent
    if any(kind == _BYTE for _, _, kind in model.pieces):
        # llama.cpp's UGM has no byte fallback: its text would get <unk> where
        # sentencepiece spells it in bytes.
        raise UnsupportedError(
            f"{file}: a SentencePiece Unigram model with byte fallback "
            "is not supported (llama.cpp's Unigram tokenizer, which llmrun follows, has none)"
        )
    settings = _read_json(folder / "tokenizer_config.json")
    settings = settings if isinstance(settings, dict) else {}
    pieces = [
        (text, score, _TYPES.get(kind, TokenType.NORMAL)) for text, score, kind in model.pieces
    ]
    special: dict[str, int] = {}
    if file.name == XLMR_FILE:
        control = TokenType.CONTROL
        first = [(text, 0.0, control) for text in XLMR_CONTROL]
        pieces = [*first, ("<unk>", 0.0, TokenType.UNKNOWN), *pieces[3:], ("<mask>", 0.0, control)]
        special = {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": len(pieces) - 1}
    elif file.name == T5_FILE:
        extra = settings.get("extra_ids", T5_EXTRA_IDS)
        if not isinstance(extra, int) or not 0 <= extra <= MAX_EXTRA_IDS:
            raise TokenizerError(
                f"{folder / 'tokenizer_config.json'}: extra_ids {extra!r} is not a number "
                f"of sentinel tokens from 0 to {MAX_EXTRA_IDS}"
            )
        pieces += [(f"<extra_id_{i}>", 0.0, TokenType.CONTROL) for i in reversed(range(extra))]
    size = config.get("vocab_size")
    size = max(size if isinstance(size, int) else 0, len(pieces))
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [UNSET_SCORE] * size
    types = [TokenType.UNUSED] * size
    for i, (piece, score, kind) in enumerate(pieces):
        tokens[i], scores[i], types[i] = piece, score, kind
    added = _read_json(folder / "added_tokens.json")
    for text, i in added.items() if isinstance(added, dict) else ():
        if isinstance(i, int) and 0 <= i < size:
            tokens[i], scores[i], types[i] = text, ADDED_SCORE, TokenType.USER_DEFINED
    metadata: dict[str, Any] = {
        Keys.Tokenizer.MODEL: "t5",
        Keys.Tokenizer.PRE: "default",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.SCORES: scores,
        Keys.Tokenizer.TOKEN_TYPE: types,
        Keys.Tokenizer.ADD_PREFIX: model.add_dummy_prefix,
        Keys.Tokenizer.REMOVE_EXTRA_WS: model.remove_extra_whitespaces,
    }
    if model.precompiled_charsmap:
        metadata[Keys.Tokenizer.PRECOMPILED_CHARSMAP] = list(model.precompiled_charsmap)
    own = {"unk": model.unk_id, "bos": model.bos_id, "eos": model.eos_id}
    for name, key in (
        ("unk", Keys.Tokenizer.UNK_ID),
        ("bos", Keys.Tokenizer.BOS_ID),
        ("eos", Keys.Tokenizer.EOS_ID),
        ("pad", Keys.Tokenizer.PAD_ID),
        ("mask", Keys.Tokenizer.MASK_ID),
    ):
        value = special.get(name, config.get(f"{name}_token_id", own.get(name)))
        if isinstance(value, int) and 0 <= value < size:
            metadata[key] = value
    if file.name == XLMR_FILE:  # XLMRobertaTokenizer's <s> ... </s> around a sequence
        metadata[Keys.Tokenizer.ADD_BOS] = metadata[Keys.Tokenizer.ADD_EOS] = True
    for name, key in (
        ("add_bos_token", Keys.Tokenizer.ADD_BOS),
        ("add_eos_token", Keys.Tokenizer.ADD_EOS),
    ):
        if isinstance(settings.get(name), bool):
            metadata[key] = settings[name]
    return metadata


def _looks_special(text: str) -> bool:
    """Added tokens the converter makes control tokens though they are not marked special."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )
