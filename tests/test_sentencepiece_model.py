"""A folder's SentencePiece tokenizer.model against the sentencepiece library itself: a BPE
model trained here (byte fallback, no normalization, as Llama's) and Unigram ones
(tests/unigram_helpers.py: T5's and sentencepiece's default ids, nmt_nfkc and identity
normalization) encode every text to the library's ids; added tokens and settings come as
llama.cpp's converter takes them. An older folder's spiece.model or sentencepiece.bpe.model
gives the ids of transformers' T5Tokenizer or XLMRobertaTokenizer."""

import json

import pytest
from helpers import STORIES_HF
from unigram_helpers import TEXTS as UNIGRAM_TEXTS
from unigram_helpers import VARIANTS, processor, train

from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.sentencepiece_model import read_model
from llmrun.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  two leading spaces, and  two  inside",
    "tabs\tand\nnewlines\n\nand trailing  ",
    "numbers 1234567 and 3.14159, emoji 🦙🚀, accents café naïve",
    "中文字符 and 日本語 mixed with English",
    "",
    " ",
    "<s> looks special but is text",
]


SIZE = 400


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A BPE tokenizer.model of SIZE pieces, trained on the bundled stories' vocabulary:
    characters past its coverage (CJK, emoji) are spelled in bytes."""
    folder = tmp_path_factory.mktemp("spm")
    vocab = json.loads((STORIES_HF / "tokenizer.json").read_text())["model"]["vocab"]
    words = [w.replace("▁", "") for w in vocab if not w.startswith("<")]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    (folder / "corpus.txt").write_text("\n".join(lines * 4 + TEXTS[:2]), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=SIZE,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=0.995,
        minloglevel=2,
    )
    return folder


def test_a_tokenizer_model_encodes_as_sentencepiece_does(folder):
    reference = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ours = Tokenizer.from_hf_dir(folder)
    assert ours.vocab_size == reference.vocab_size()
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, True)
    for text in TEXTS:
        expected = [1] + reference.encode(text)
        assert ours.encode(text, parse_special=False) == expected, text
        assert ours.decode(expected[1:]) == reference.decode(expected[1:]), text


def test_added_tokens_and_settings_are_the_converters(folder, tmp_path):
    for name in ("tokenizer.model", "tokenizer.vocab"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": SIZE + 4}))
    # Two added tokens past the model's pieces, and two of padding.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": False,
                "eos_token": "<|end|>",
                "added_tokens_decoder": {
                    f"{SIZE}": {"content": "<|end|>", "special": True},
                    f"{SIZE + 1}": {"content": "▁hello▁there", "special": False},
                },
            }
        )
    )
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert (ours.vocab_size, ours.eos_id, ours.add_bos) == (SIZE + 4, SIZE, False)
    assert SIZE in ours.special_ids and SIZE in ours.eog_ids
    # The user-defined token is matched in text, its ▁ read as spaces (the converter's).
    ids = ours.encode("say hello there<|end|>", parse_special=True)
    assert SIZE + 1 in ids and ids[-1] == SIZE
    assert ours.decode(ids) == "say hello there"


def test_a_file_that_is_not_a_model_is_refused(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05\x0a\x03abc\xff")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        read_model(b"\x0a\xff\xff\xff\xff\x0f", "x")


def unigram_folder(path, name: str, extra: int = 0):
    """unigram_helpers' trained Unigram model VARIANTS[name] as a folder's tokenizer.model,
    config.json's vocab_size `extra` past its pieces (T5's ids in config.json where it was
    trained with them), and sentencepiece's processor of it."""
    normalization, options, _ = VARIANTS[name]
    proto = train(normalization, **options)
    path.mkdir()
    (path / "tokenizer.model").write_bytes(proto)
    reference = processor(proto)
    config = {"vocab_size": reference.vocab_size() + extra}
    if options.get("eos_id") == 1:
        config |= {"eos_token_id": 1, "pad_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("name", ["nfkc-t5", "identity-t5", "nfkc-xlmr", "identity-xlmr"])
def test_a_unigram_model_encodes_as_sentencepiece_does(tmp_path, name):
    """nmt_nfkc (its precompiled charsmap) and identity normalization, extra whitespace
    removed or kept, with and without the space prefix, T5's ids and sentencepiece's
    defaults: sentencepiece's ids and decode, EOS after a sequence (llama.cpp's Unigram
    default). As llama.cpp, a text of spaces alone, with the spaces kept, gets no prefix,
    and <unk> decodes to nothing."""
    reference = unigram_folder(tmp_path / name, name, extra=28)
    ours = Tokenizer.from_hf_dir(tmp_path / name)
    assert ours.vocab_size == reference.vocab_size() + 28
    assert (ours.eos_id, ours.add_bos, ours.add_eos) == (reference.eos_id(), False, True)
    keeps_spaces = VARIANTS[name][1].get("remove_extra_whitespaces") is False
    prefix = VARIANTS[name][1].get("add_dummy_prefix", True)
    for text in UNIGRAM_TEXTS:
        expected = reference.encode(text)
        if keeps_spaces and prefix and text and not text.strip(" "):
            expected = expected[1:]
        assert ours.encode(text, parse_special=False) == expected, text
        if reference.unk_id() not in expected:  # sentencepiece spells <unk> " \u2047 "
            assert ours.decode(expected) == reference.decode(expected), text
    assert ours.encode_sequence("Hello world") == reference.encode("Hello world") + [
        reference.eos_id()
    ]


def test_a_unigram_folders_settings_are_the_converters(tmp_path):
    """added_tokens.json's tokens are user-defined ones, matched in text; tokenizer_config's
    add_*_token flags are the file's."""
    reference = unigram_folder(tmp_path / "t5", "nfkc-t5", extra=2)
    size = reference.vocab_size()
    (tmp_path / "t5" / "added_tokens.json").write_text(json.dumps({"<extra_id_0>": size}))
    settings = {"add_bos_token": True, "add_eos_token": False}
    (tmp_path / "t5" / "tokenizer_config.json").write_text(json.dumps(settings))
    ours = Tokenizer.from_hf_dir(tmp_path / "t5")
    assert (ours.add_bos, ours.add_eos, ours.bos_id) == (True, False, None)
    ids = ours.encode("Hello<extra_id_0>world")
    assert ids == reference.encode("Hello") + [size] + reference.encode("world")
    assert ours.encode_sequence("Hello") == reference.encode("Hello")


def test_a_unigram_model_with_byte_fallback_is_refused(tmp_path):
    folder = tmp_path / "bytes"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(train(vocab_size=700, byte_fallback=True))
    with pytest.raises(UnsupportedError, match="Unigram model with byte fallback"):
        Tokenizer.from_hf_dir(folder)


# Special-token text as these tokenizers read it in a text.
SPECIAL_TEXTS = ["Hello <extra_id_0> world<extra_id_1>!", "a <mask> b", "x</s> <pad>y<unk> z"]


@pytest.mark.parametrize(
    ("name", "file", "settings"),
    [
        ("nfkc-t5", "spiece.model", {}),
        ("nfkc-t5", "spiece.model", {"extra_ids": 3}),
        ("nfkc-xlmr", "sentencepiece.bpe.model", {}),
    ],
)
def test_older_sentencepiece_files_give_their_transformers_tokenizers_ids(
    tmp_path, name, file, settings
):
    """A folder whose only tokenizer is T5Tokenizer's spiece.model (sentinels <extra_id_N>
    after the pieces, <extra_id_0> last) or XLMRobertaTokenizer's sentencepiece.bpe.model
    (fairseq's <s> <pad> </s> <unk>, every other piece one id later, <mask> last): the ids
    transformers' tokenizer of that class gives, with and without its special tokens, on
    the multilingual texts. The models are nmt_nfkc ones with sentencepiece's default
    normalizer settings, as T5's and XLM-R's are (transformers' converter drops the
    settings, so on other ones it is not a reference)."""
    import transformers

    normalization, options, _ = VARIANTS[name]
    folder = tmp_path / name
    folder.mkdir()
    (folder / file).write_bytes(train(normalization, **options))
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    kind = transformers.T5Tokenizer if file == "spiece.model" else transformers.XLMRobertaTokenizer
    reference = kind.from_pretrained(folder)
    ours = Tokenizer.from_hf_dir(folder)
    assert ours.vocab_size == len(reference)
    for token, i in reference.get_vocab().items():
        assert ours.token_id(token) == i, token
    for text in UNIGRAM_TEXTS + SPECIAL_TEXTS:
        assert ours.encode_sequence(text) == reference(text).input_ids, text
        plain = reference(text, add_special_tokens=False).input_ids
        assert ours.encode(text, add_bos=False) == plain, text


def test_older_sentencepiece_files_that_transformers_reads_otherwise_are_refused(folder, tmp_path):
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    (bpe / "spiece.model").write_bytes((folder / "tokenizer.model").read_bytes())
    with pytest.raises(UnsupportedError, match="BPE model is supported as tokenizer.model only"):
        Tokenizer.from_hf_dir(bpe)
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "spiece.model").write_bytes(train(**VARIANTS["nfkc-t5"][1]))
    (t5 / "tokenizer_config.json").write_text(json.dumps({"extra_ids": -1}))
    with pytest.raises(TokenizerError, match="extra_ids -1 is not a number"):
        Tokenizer.from_hf_dir(t5)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _varint(value: int) -> bytes:
    out = b""
    while True:
        out += bytes([value & 0x7F | (0x80 if value > 0x7F else 0)])
        value >>= 7
        if not value:
            return out


def _message(number: int, body: bytes) -> bytes:
    return _field(number, 2, _varint(len(body)) + body)


def test_a_folder_with_tokenizer_model_runs_as_its_gguf(tmp_path):
    """stories260K's folder with the GGUF's vocabulary as a tokenizer.model (the protobuf
    llama2.c's tok512.model is) in place of tokenizer.json: `run` tells the same story."""
    import shutil
    import struct

    from helpers import STORIES_GGUF
    from in_process import llmrun

    from llmrun.loading.gguf_io import read_gguf

    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    pieces = b"".join(
        _message(
            1,
            _message(1, token.encode())
            + _field(2, 5, struct.pack("<f", score))
            + _field(3, 0, _varint(kind)),
        )
        for token, score, kind in zip(
            meta["tokenizer.ggml.tokens"],
            meta["tokenizer.ggml.scores"],
            meta["tokenizer.ggml.token_type"],
            strict=True,
        )
    )
    trainer = _field(3, 0, _varint(2)) + b"".join(
        _field(n, 0, _varint(i)) for n, i in ((40, 0), (41, 1), (42, 2))
    )
    folder = tmp_path / "stories"
    shutil.copytree(STORIES_HF, folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(pieces + _message(2, trainer))
    run = ["run", "-n", "20", "--temperature", "0"]
    expected = llmrun(*run, str(STORIES_HF), "Once upon a time")
    got = llmrun(*run, str(folder), "Once upon a time")
    assert got.returncode == 0, got.stderr
    assert got.stdout == expected.stdout and len(expected.stdout) > 40
