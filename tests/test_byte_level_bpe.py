"""A Blenderbot folder's vocab.json and merges.txt (no tokenizer.json; llmrun.byte_level_bpe)
against transformers 5's BlenderbotTokenizer of the same folder: equal ids (no </s> added,
as it adds none) and decoded text on varied strings and the special tokens' text, with and
without add_prefix_space; BlenderbotSmallTokenizer's files of the same names are refused."""

import json

import pytest
from bart_kin_helpers import vocab_and_merges
from unigram_helpers import CORPUS, TEXTS

from llmrun.errors import UnsupportedError
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("prefix", [True, False])
def test_ids_and_text_are_blenderbot_tokenizers(tmp_path, prefix):
    vocab_and_merges(tmp_path)
    settings = {"tokenizer_class": "BlenderbotTokenizer", "add_prefix_space": prefix}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    texts = [*TEXTS, *CORPUS, "a <mask> b</s><s> <unk>", " <mask>x", "<pad>"]
    for text in texts:
        ids = expected(text).input_ids
        assert tokenizer.encode_sequence(text) == ids, text
        assert tokenizer.decode(ids) == expected.decode(ids, skip_special_tokens=True), text


def test_blenderbot_small_files_are_refused(tmp_path):
    vocab_and_merges(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "blenderbot-small"}))
    with pytest.raises(UnsupportedError) as refused:
        load_tokenizer(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path / 'vocab.json'} with merges.txt (BlenderbotSmallTokenizer's) is not "
        "supported: BlenderbotTokenizer's is, and a folder with tokenizer.json"
    )
