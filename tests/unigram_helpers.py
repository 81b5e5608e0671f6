"""Small real SentencePiece Unigram models, trained here by the `sentencepiece` library, and
their GGUF tokenizer metadata as llama.cpp's converter writes it: conversion/t5.py
(T5Model.set_vocab: the pieces as they are, T5's ids pad 0, eos 1, unk 2, padded with
[PADn] unused tokens to the config's vocab_size) and conversion/bert.py
(_xlmroberta_set_vocab: fairseq's <s> <pad> </s> <unk> first, every other piece one id
later); both with the model's normalizer spec (precompiled_charsmap when it has one,
add_dummy_prefix as add_space_prefix, remove_extra_whitespaces) and what gguf-py's
SpecialVocab reads of the HF folder's tokenizer.json (T5: eos appended; XLM-R: <s> ... </s>).
"""

from __future__ import annotations

import io

import gguf
from gguf import Keys, TokenType

# Training text: the scripts and forms the test strings use.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a test of the tokenizer and of its pieces.",
    "Le café est très bon à Paris, n'est-ce pas? Où est la gare?",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein, sagt man.",
    "日本語のテキストも少し含めます。東京は大きな都市です。",
    "中文文本也包括在内，北京是中国的首都。",
    "Привет, как дела? Всё хорошо, спасибо.",
    "Numbers 1234567890 and 3.14159 and 2024-12-05 at 10:30.",
    "Ｆｕｌｌ－ｗｉｄｔｈ ｌｅｔｔｅｒｓ ａｎｄ ｄｉｇｉｔｓ １２３",
    "Tabs\tand\nnew lines and    many spaces between words.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "Peter Piper picked a peck of pickled peppers, where is the peck he picked?",
    "Les enfants jouent dans le jardin pendant que leurs parents préparent le dîner.",
    "Die Katze schläft auf dem Sofa, während der Hund im Garten spielt.",
    "私は毎朝コーヒーを飲みます。今日はとても良い天気ですね。",
    "我们明天去公园散步，然后一起吃晚饭。",
    "Москва — столица России, а Санкт-Петербург — её культурная столица.",
]
# Strings each tokenizer is checked on: CJK, accents (composed and decomposed), full-width
# characters, emoji (unknown to the vocabulary), runs of spaces, tabs and newlines, digits,
# control characters, the empty string, only spaces, and special-token text.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Le café est très bon à Paris",
    "Cafe\u0301 and caf\u00e9",
    "日本語のテキスト、東京。",
    "中文文本，北京是首都。",
    "Привет, как дела?",
    "Ｆｕｌｌ－ｗｉｄｔｈ ＡＢＣ １２３",
    "emoji 😀🎉 and ✨ sparkles",
    "  many    spaces   ",
    "tabs\tand\nnewlines\r\nmixed \t \n end",
    "1234567890 3.14159 2024-12-05",
    "bell\x07 and zero\u200bwidth",
    "ﬁne ① Ⅻ ㍿",
    "",
    "     ",
    "\n",
    "</s> and <unk> as text",
    "Hello😀world😀😀end",
]


def train(normalization: str = "nmt_nfkc", vocab_size: int = 400, **options) -> bytes:
    """A SentencePiece Unigram model (the serialized ModelProto) trained on CORPUS."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        normalization_rule_name=normalization,
        num_threads=1,
        minloglevel=2,
        **options,
    )
    return model.getvalue()


def processor(proto: bytes):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=proto)


def _fields(data: bytes):
    """(field number, value) of a protobuf message: varints as ints, the rest as bytes."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while pos < len(data):
        key = varint()
        wire = key & 7
        if wire == 0:
            yield key >> 3, varint()
        elif wire == 2:
            n = varint()
            yield key >> 3, data[pos : pos + n]
            pos += n
        else:
            size = {1: 8, 5: 4}[wire]
            yield key >> 3, data[pos : pos + size]
            pos += size


def normalizer_spec(proto: bytes) -> tuple[bytes, bool, bool]:
    """ModelProto.normalizer_spec (field 3): precompiled_charsmap (2), add_dummy_prefix (3)
    and remove_extra_whitespaces (4), with the proto's defaults."""
    charsmap, add_prefix, remove_ws = b"", True, True
    for number, value in _fields(proto):
        if number != 3:
            continue
        for n, v in _fields(value):
            if n == 2:
                charsmap = v
            elif n == 3:
                add_prefix = bool(v)
            elif n == 4:
                remove_ws = bool(v)
    return charsmap, add_prefix, remove_ws


def _pieces(proto: bytes, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """The converter's loop over SentencePieceProcessor's pieces, over [PADn] fillers."""
    sp = processor(proto)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(TokenType.UNUSED)] * vocab_size
    for i in range(sp.vocab_size()):
        kind = TokenType.NORMAL
        if sp.IsUnknown(i):
            kind = TokenType.UNKNOWN
        elif sp.IsControl(i):
            kind = TokenType.CONTROL
        elif sp.IsUnused(i):
            kind = TokenType.UNUSED
        elif sp.IsByte(i):
            kind = TokenType.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i), sp.GetScore(i), int(kind)
    return tokens, scores, types


def _normalizer_keys(proto: bytes) -> dict:
    charsmap, add_prefix, remove_ws = normalizer_spec(proto)
    keys = {Keys.Tokenizer.ADD_PREFIX: add_prefix, Keys.Tokenizer.REMOVE_EXTRA_WS: remove_ws}
    if charsmap:
        keys[Keys.Tokenizer.PRECOMPILED_CHARSMAP] = list(charsmap)
    return keys


def t5_metadata(proto: bytes, extra: int = 28) -> dict:
    """T5's GGUF tokenizer metadata of a model trained with T5's ids (`t5_options`), the
    config's vocab_size `extra` tokens larger than the model (t5-small: 32128 for 32100)."""
    size = processor(proto).vocab_size() + extra
    tokens, scores, types = _pieces(proto, size)
    return {
        Keys.Tokenizer.MODEL: "t5",
        Keys.Tokenizer.PRE: "default",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.SCORES: scores,
        Keys.Tokenizer.TOKEN_TYPE: types,
        **_normalizer_keys(proto),
        Keys.Tokenizer.EOS_ID: 1,
        Keys.Tokenizer.UNK_ID: 2,
        Keys.Tokenizer.PAD_ID: 0,
        Keys.Tokenizer.ADD_EOS: True,
    }


# T5's spiece.model ids: pad 0, eos 1, unk 2, no bos.
T5_OPTIONS = dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1)


def xlmr_metadata(proto: bytes) -> dict:
    """XLM-RoBERTa's (bge-m3's, multilingual-e5's) GGUF tokenizer metadata of a model with
    SentencePiece's default ids (unk 0, bos 1, eos 2): the config's vocab_size is the model's
    + 2 (bge-m3: 250002 for 250000), <mask> (the last id) left a [PADn] filler."""
    size = processor(proto).vocab_size() + 2
    tokens, scores, types = _pieces(proto, size)
    control, unknown = int(TokenType.CONTROL), int(TokenType.UNKNOWN)
    return {
        Keys.Tokenizer.MODEL: "t5",
        Keys.Tokenizer.PRE: "default",
        Keys.Tokenizer.LIST: ["<s>", "<pad>", "</s>", "<unk>"] + tokens[3:-1],
        Keys.Tokenizer.SCORES: [0.0] * 4 + scores[3:-1],
        Keys.Tokenizer.TOKEN_TYPE: [control, control, control, unknown] + types[3:-1],
        **_normalizer_keys(proto),
        Keys.Tokenizer.BOS_ID: 0,
        Keys.Tokenizer.EOS_ID: 2,
        Keys.Tokenizer.UNK_ID: 3,
        Keys.Tokenizer.SEP_ID: 2,
        Keys.Tokenizer.PAD_ID: 1,
        Keys.Tokenizer.MASK_ID: size - 1,
        Keys.Tokenizer.ADD_BOS: True,
        Keys.Tokenizer.ADD_EOS: True,
        Keys.Tokenizer.ADD_SEP: True,
    }


# The trained vocabularies: name -> (normalization, training options, layout): nmt_nfkc,
# and identity keeping extra whitespace with and without the space prefix.
VARIANTS = {
    "nfkc-t5": ("nmt_nfkc", T5_OPTIONS, "t5"),
    "nfkc-xlmr": ("nmt_nfkc", {}, "xlmr"),
    "identity-t5": ("identity", {**T5_OPTIONS, "remove_extra_whitespaces": False}, "t5"),
    "identity-xlmr": (
        "identity",
        {"remove_extra_whitespaces": False, "add_dummy_prefix": False},
        "xlmr",
    ),
}


def trained(name: str) -> tuple[bytes, dict]:
    """VARIANTS[name]'s model (the serialized ModelProto) and its GGUF tokenizer metadata."""
    normalization, options, layout = VARIANTS[name]
    proto = train(normalization, **options)
    return proto, (t5_metadata if layout == "t5" else xlmr_metadata)(proto)


def xlmr_ids(spm_ids: list[int]) -> list[int]:
    """fairseq's ids of SentencePiece ids: <unk> (0) is 3, every other piece one later."""
    return [3 if i == 0 else i + 1 for i in spm_ids]


def add_tokenizer(writer: gguf.GGUFWriter, metadata: dict) -> None:
    """The metadata written with the gguf-py calls the converter makes."""
    writer.add_tokenizer_model(metadata[Keys.Tokenizer.MODEL])
    writer.add_tokenizer_pre(metadata[Keys.Tokenizer.PRE])
    writer.add_token_list(metadata[Keys.Tokenizer.LIST])
    writer.add_token_scores(metadata[Keys.Tokenizer.SCORES])
    writer.add_token_types(metadata[Keys.Tokenizer.TOKEN_TYPE])
    writer.add_add_space_prefix(metadata[Keys.Tokenizer.ADD_PREFIX])
    writer.add_remove_extra_whitespaces(metadata[Keys.Tokenizer.REMOVE_EXTRA_WS])
    if Keys.Tokenizer.PRECOMPILED_CHARSMAP in metadata:
        writer.add_precompiled_charsmap(bytes(metadata[Keys.Tokenizer.PRECOMPILED_CHARSMAP]))
    for key, value in metadata.items():
        if key.endswith("_token_id"):
            writer.add_uint32(key, value)
        elif key.startswith("tokenizer.ggml.add_") and key != Keys.Tokenizer.ADD_PREFIX:
            writer.add_bool(key, value)


def write_tokenizer_gguf(path, metadata: dict):
    """A GGUF holding only the tokenizer (arch "bert"), for `llmrun tokenize`."""
    writer = gguf.GGUFWriter(str(path), "bert")
    add_tokenizer(writer, metadata)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A hand-made T5-layout vocabulary whose texts (RULE_TEXTS) each show one rule of llama.cpp's
# UGM search (no space prefix, spaces kept, no charsmap: "\u2581" is a space).
_C, _N, _K, _U, _D, _B = (
    int(t)
    for t in (
        TokenType.CONTROL,
        TokenType.NORMAL,
        TokenType.UNKNOWN,
        TokenType.USER_DEFINED,
        TokenType.UNUSED,
        TokenType.BYTE,
    )
)
RULES_VOCAB = [  # text, score, type
    ("<pad>", 0.0, _C),
    ("</s>", 0.0, _C),
    ("<unk>", 0.0, _K),
    ("\u2581", -2.0, _N),
    ("a", -1.0, _N),
    ("b", -1.0, _N),
    ("ab", -2.0, _N),
    ("y", 11.5, _N),
    ("zy", -4.0, _N),
    ("c", -5.0, _N),  # the lowest normal score: an unknown character scores -15
    ("<x>", -1000.0, _U),
    ("[PAD0]", -10000.0, _D),
    ("\u2581c", -3.0, _D),
    ("<0x41>", 0.0, _B),
]
RULE_TEXTS = {  # text -> ids (parse_special off)
    "ab": [6],  # a tie (a + b = ab = -2): the first path found, "ab", stays
    # An unknown z and y (-15 + 11.5) beat zy (-4): the unknown's score is the lowest
    # normal score less 10, the unused filler's -10000 not counted.
    "zy": [2, 7],
    "zzzy": [2, 7],  # a run of unknowns is one <unk>
    " c": [12],  # an unused token scored above the lowest normal one is matched
    "a<x>b": [4, 10, 5],  # user-defined tokens are always matched
    "A": [2],  # no byte fallback: byte tokens are never matched
    "[PAD0]": [2],  # the converter's [PADn] fillers lose to unknowns
    "</s>": [2],  # control tokens are never matched in text
}


def rules_metadata() -> dict:
    return {
        Keys.Tokenizer.MODEL: "t5",
        Keys.Tokenizer.PRE: "default",
        Keys.Tokenizer.LIST: [t for t, _, _ in RULES_VOCAB],
        Keys.Tokenizer.SCORES: [s for _, s, _ in RULES_VOCAB],
        Keys.Tokenizer.TOKEN_TYPE: [k for _, _, k in RULES_VOCAB],
        Keys.Tokenizer.ADD_PREFIX: False,
        Keys.Tokenizer.REMOVE_EXTRA_WS: False,
        Keys.Tokenizer.EOS_ID: 1,
        Keys.Tokenizer.UNK_ID: 2,
        Keys.Tokenizer.PAD_ID: 0,
        Keys.Tokenizer.ADD_EOS: True,
    }
