"""WordPiece: GGUF "bert" vocabularies tokenized as llama.cpp's WPM tokenizes them (every
string of its ggml-vocab-bert-bge test set: tests/test_tokenizer.py), each of its rules
here on a vocabulary written as conversion/bert.py writes one (word-initial pieces after
"\u2581", continuations without BERT's "##", control tokens as they are); and BERT folders'
tokenizer.json, whose [CLS] ... [SEP] an embedding's input takes as transformers does."""

import pytest
from gguf import Keys, TokenType

from llmrun.tokenizer import Tokenizer
from llmrun.wordpiece import LOWERCASE_KEY, STRIP_ACCENTS_KEY, wordpiece_vocab

CONTROL, NORMAL = int(TokenType.CONTROL), int(TokenType.NORMAL)
# BERT's vocabulary: [PAD] [UNK] [CLS] [SEP], then pieces (## = a continuation).
PIECES = ["hello", "world", "play", "##ing", "##s", ",", "!", "a", "##a", "cafe", "日", "本"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def phantom(piece: str) -> str:
    """conversion/bert.py's spelling of a piece (phantom())."""
    return piece[2:] if piece.startswith("##") else "\u2581" + piece


def metadata(**changes) -> dict:
    meta = {
        Keys.Tokenizer.MODEL: "bert",
        Keys.Tokenizer.PRE: "default",
        Keys.Tokenizer.LIST: SPECIALS + [phantom(p) for p in PIECES],
        Keys.Tokenizer.TOKEN_TYPE: [CONTROL] * 4 + [NORMAL] * len(PIECES),
        Keys.Tokenizer.UNK_ID: 1,
        Keys.Tokenizer.BOS_ID: 2,
        Keys.Tokenizer.SEP_ID: 3,
        Keys.Tokenizer.PAD_ID: 0,
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def ids(*pieces: str) -> list[int]:
    vocab = SPECIALS + PIECES
    return [vocab.index(p) for p in pieces]


def tokenizer(**changes) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata(**changes), "bert.gguf")


def test_the_vocabulary_is_spelled_as_berts_again():
    meta = metadata()
    vocab = wordpiece_vocab(meta[Keys.Tokenizer.LIST], meta[Keys.Tokenizer.TOKEN_TYPE])
    assert vocab == {token: i for i, token in enumerate(SPECIALS + PIECES)}


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Hello, WORLD!", ("hello", ",", "world", "!")),  # lower-cased, punctuation alone
        ("playing plays", ("play", "##ing", "play", "##s")),  # longest pieces first
        ("playx hello", ("[UNK]", "hello")),  # a word with a part no piece matches
        ("Café  \t\n hello", ("cafe", "hello")),  # accents stripped, whitespace runs
        ("hel\x00lo\u200b wor\x07ld", ("hello", "world")),  # control characters dropped
        ("日本hello", ("日", "本", "hello")),  # CJK ideographs are words of their own
        ("a" * 150, ("a",) + ("##a",) * 149),  # no limit on a word's length
        ("", ()),
    ],
)
def test_words_are_split_and_matched_as_llama_cpp_does(text, pieces):
    assert tokenizer().encode(text, add_bos=False) == ids(*pieces)


def test_a_sequence_is_cls_text_sep():
    tok = tokenizer()
    assert tok.bos_id == 2 and tok.eos_id == 3 and tok.add_bos and tok.add_eos
    assert tok.encode_sequence("hello world") == ids("[CLS]", "hello", "world", "[SEP]")
    no_sep = tokenizer(**{Keys.Tokenizer.ADD_SEP: False})
    assert no_sep.encode_sequence("hello") == ids("[CLS]", "hello")


def test_special_token_text_is_parsed_only_when_asked():
    tok = tokenizer()
    assert tok.encode("[SEP] hello", add_bos=False) == ids("[SEP]", "hello")
    assert tok.encode("[SEP] hello", add_bos=False, parse_special=False) == ids(
        "[UNK]", "[UNK]", "[UNK]", "hello"
    )


def test_the_normalizer_options_are_the_files():
    cased = tokenizer(**{LOWERCASE_KEY: False})
    assert cased.encode("Hello hello", add_bos=False) == ids("[UNK]", "hello")
    # strip_accents follows lowercase unless the file says otherwise.
    assert cased.encode("café", add_bos=False) == ids("[UNK]")
    stripped = tokenizer(**{LOWERCASE_KEY: False, STRIP_ACCENTS_KEY: True})
    assert stripped.encode("café", add_bos=False) == ids("cafe")


def test_decoding_joins_continuations_to_their_words():
    tok = tokenizer()
    assert tok.decode(ids("[CLS]", "hello", "play", "##ing", "[SEP]")) == "hello playing"


def test_a_bert_folders_tokenizer_json_adds_cls_and_sep_as_transformers(tmp_path):
    """A tokenizer.json as BERT's folders hold it (BertNormalizer, BertPreTokenizer,
    WordPiece, a [CLS] $A [SEP] post-processor, a WordPiece decoder), compared with the
    `tokenizers` library's own encoding of it, which transformers' fast tokenizer is."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.implementations import BertWordPieceTokenizer

    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("\n".join(SPECIALS + ["[MASK]"] + PIECES) + "\n")
    (tmp_path / "tok").mkdir()
    BertWordPieceTokenizer(str(vocab_file)).save(str(tmp_path / "tok" / "tokenizer.json"))
    reference = Backend.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(tmp_path / "tok")
    for text in ("Hello, WORLD!", "playing plays café", "日本 playx"):
        expected = reference.encode(text).ids
        assert expected[0] == 2 and expected[-1] == 3  # [CLS] ... [SEP]
        assert tok.encode_sequence(text) == expected
    assert tok.decode(reference.encode("hello playing").ids) == "hello playing"
