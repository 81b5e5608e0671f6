"""GGUF Unigram ("t5") vocabularies tokenized as llama.cpp's UGM tokenizes them
(llmrun.unigram), against sentencepiece itself: small real SentencePiece Unigram models are
trained here (nmt_nfkc, whose precompiled charsmap the GGUF carries; identity, keeping extra
whitespace, with and without the space prefix) and written as llama.cpp's converter writes T5
and XLM-RoBERTa vocabularies (tests/unigram_helpers.py). Every string of a fixed multilingual
set gives sentencepiece's own ids (moved to fairseq's for XLM-R), with the BOS/EOS the file
asks for around a sequence, and decodes back to sentencepiece's decode.

Where llama.cpp knowingly differs from sentencepiece, the test follows llama.cpp (its
llama-server gave the same ids for every string and rule here:
benchmarks/llama_cpp_unigram.py): a text of spaces alone, with the spaces kept, gets no
space prefix (llama.cpp prepends "\u2581" before the first non-space character only;
sentencepiece always). The rules of the search itself are each shown on a hand-made
vocabulary (unigram_helpers.RULES_VOCAB).
"""

import pytest
from gguf import Keys
from in_process import llmrun
from unigram_helpers import (
    RULE_TEXTS,
    TEXTS,
    VARIANTS,
    processor,
    rules_metadata,
    trained,
    write_tokenizer_gguf,
    xlmr_ids,
)

from llmrun.errors import TokenizerError
from llmrun.tokenizer import Tokenizer, load_tokenizer


class Variant:
    """A trained vocabulary (unigram_helpers.VARIANTS): sentencepiece's and llmrun's."""

    def __init__(self, name: str) -> None:
        proto, self.metadata = trained(name)
        self.layout = VARIANTS[name][2]
        self.sp = processor(proto)
        self.tok = Tokenizer.from_gguf_metadata(self.metadata, f"{name}.gguf")
        self.keeps_spaces = not self.metadata[Keys.Tokenizer.REMOVE_EXTRA_WS]
        self.prefix = self.metadata[Keys.Tokenizer.ADD_PREFIX]

    def expected(self, text: str) -> list[int]:
        """sentencepiece's ids, as llama.cpp gives them."""
        ids = self.sp.encode(text)
        if self.keeps_spaces and self.prefix and text and not text.strip(" "):
            ids = ids[1:]  # llama.cpp adds no prefix before spaces alone
        return ids if self.layout == "t5" else xlmr_ids(ids)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> Variant:
    return Variant(request.param)


def test_texts_give_sentencepieces_ids(variant):
    for text in TEXTS:
        got = variant.tok.encode(text, add_bos=False, parse_special=False)
        assert got == variant.expected(text), text


def test_the_known_difference_is_spaces_alone():
    """What expected() moves: sentencepiece puts its prefix before spaces alone."""
    v = Variant("identity-t5")
    assert v.sp.encode("   ") == [v.sp.PieceToId("\u2581")] * 4
    assert v.tok.encode("   ", add_bos=False) == [v.sp.PieceToId("\u2581")] * 3


def test_a_sequence_has_the_special_tokens_the_file_asks_for(variant):
    text = "Hello world"
    ids = variant.expected(text)
    if variant.layout == "t5":  # </s> after, no BOS
        assert variant.tok.bos_id is None and not variant.tok.add_bos
        assert variant.tok.encode_sequence(text) == ids + [1]
    else:  # <s> ... </s>
        assert variant.tok.encode(text) == [0] + ids
        assert variant.tok.encode_sequence(text) == [0] + ids + [2]


def test_special_token_text_is_parsed_only_when_asked(variant):
    tok = variant.tok
    eos = tok.token_id("</s>")
    assert eos == (1 if variant.layout == "t5" else 2)
    plain = tok.encode("a</s>b", add_bos=False, parse_special=False)
    assert eos not in plain
    parsed = tok.encode("a</s>b", add_bos=False)
    # llama.cpp tokenizes the text on each side of a special token on its own.
    assert parsed == tok.encode("a", add_bos=False) + [eos] + tok.encode("b", add_bos=False)


def test_the_ids_decode_to_sentencepieces_text(variant):
    unk = variant.tok.token_id("<unk>")
    for text in TEXTS:
        ids = variant.tok.encode(text, add_bos=False, parse_special=False)
        if unk in ids:  # sentencepiece decodes <unk> as " \u2047 ", llama.cpp as nothing
            continue
        decoded = variant.tok.decode(ids)
        spm_ids = ids if variant.layout == "t5" else [i - 1 for i in ids]
        assert decoded == variant.sp.decode(spm_ids), text
        stream = variant.tok.stream()
        assert "".join(stream.add(i) for i in ids) + stream.flush() == decoded
        assert variant.tok.decode(variant.tok.encode_sequence(text)) == decoded


def test_a_written_gguf_reads_the_same(tmp_path):
    v = Variant("nfkc-xlmr")
    tok = load_tokenizer(write_tokenizer_gguf(tmp_path / "v.gguf", v.metadata))
    for text in TEXTS:
        assert tok.encode(text, parse_special=False) == v.tok.encode(text, parse_special=False)


@pytest.mark.parametrize(("text", "ids"), list(RULE_TEXTS.items()))
def test_the_search_follows_llama_cpps_rules(text, ids):
    tok = Tokenizer.from_gguf_metadata(rules_metadata(), "rules.gguf")
    assert tok.encode(text, parse_special=False) == ids


def test_llama_cpps_defaults_where_the_file_says_nothing():
    """No add_space_prefix, remove_extra_whitespaces or charsmap: none; no unknown or eos id:
    2 and 1; no add_bos/add_eos: no BOS, EOS appended."""
    meta = rules_metadata()
    for key in (Keys.Tokenizer.ADD_PREFIX, Keys.Tokenizer.REMOVE_EXTRA_WS, Keys.Tokenizer.EOS_ID):
        del meta[key]
    del meta[Keys.Tokenizer.UNK_ID], meta[Keys.Tokenizer.ADD_EOS]
    tok = Tokenizer.from_gguf_metadata(meta, "rules.gguf")
    assert tok.encode_sequence(" ab  ab") == [3, 6, 3, 3, 6, 1]
    assert tok.encode("q") == [2]


@pytest.mark.parametrize(
    ("charsmap", "message"),
    [
        ([1, 0], "too short"),
        ([255, 255, 0, 0, 0, 0, 0, 0], "says its trie has 65535 bytes"),
        ([4, 0, 0, 0, 0, 0, 0, 0, 97], "ends inside a replacement"),
        ("abc", "not an array of bytes"),
    ],
)
def test_a_damaged_charsmap_is_refused(charsmap, message):
    meta = rules_metadata() | {Keys.Tokenizer.PRECOMPILED_CHARSMAP: charsmap}
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf_metadata(meta, "bad.gguf")


def test_a_vocabulary_without_normal_tokens_is_refused():
    meta = rules_metadata() | {
        Keys.Tokenizer.TOKEN_TYPE: [3] * len(rules_metadata()[Keys.Tokenizer.LIST])
    }
    with pytest.raises(TokenizerError, match="without normal tokens"):
        Tokenizer.from_gguf_metadata(meta, "bad.gguf")


def test_tokenize_prints_ids_or_one_error_line(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "rules.gguf", rules_metadata())
    result = llmrun("tokenize", str(path), "zzzy ab", "--no-special")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[2, 7, 3, 6]\n"
    bad = rules_metadata() | {Keys.Tokenizer.PRECOMPILED_CHARSMAP: [1, 0]}
    result = llmrun("tokenize", str(write_tokenizer_gguf(tmp_path / "bad.gguf", bad)), "x")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and "too short" in result.stderr
