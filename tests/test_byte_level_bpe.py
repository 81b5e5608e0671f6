"""A Blenderbot folder's vocab.json and merges.txt (no tokenizer.json; llmrun.byte_level_bpe)
against transformers 5's BlenderbotTokenizer of the same folder: equal ids (no </s> added,
as it adds none) and decoded text on varied strings and the special tokens' text, with and
without add_prefix_space; so for RobertaTokenizer's (<s> ... </s>; <mask>'s lstrip from
tokenizer_config.json, its added_tokens_decoder or special_tokens_map.json, or none);
BlenderbotSmallTokenizer's files of the same names are refused."""

import json

import pytest
from bart_kin_helpers import vocab_and_merges
from unigram_helpers import CORPUS, TEXTS

from llmrun.errors import UnsupportedError
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")


_MASK = {"content": "<mask>", "lstrip": True, "rstrip": False, "normalized": True}
# (tokenizer_config.json's settings, special_tokens_map.json's or None)
SETTINGS = {
    "blenderbot": ({"tokenizer_class": "BlenderbotTokenizer", "add_prefix_space": True}, None),
    "blenderbot-no-prefix": (
        {"tokenizer_class": "BlenderbotTokenizer", "add_prefix_space": False},
        None,
    ),
    "roberta": ({"tokenizer_class": "RobertaTokenizer"}, None),
    # as microsoft/trocr-base-handwritten's: <mask> takes the space before it
    "roberta-mask": (
        {"tokenizer_class": "RobertaTokenizer", "mask_token": {**_MASK, "__type": "AddedToken"}},
        None,
    ),
    "roberta-decoder-prefix": (
        {
            "tokenizer_class": "RobertaTokenizer",
            "add_prefix_space": True,
            "added_tokens_decoder": {"4": {**_MASK, "special": True}},
        },
        {"mask_token": {**_MASK, "lstrip": False}},  # ignored beside added_tokens_decoder
    ),
    "roberta-map": ({"tokenizer_class": "RobertaTokenizer"}, {"mask_token": _MASK}),
}


@pytest.mark.parametrize("kind", SETTINGS)
def test_ids_and_text_are_transformers(tmp_path, kind):
    vocab_and_merges(tmp_path)
    settings, mapped = SETTINGS[kind]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    if mapped is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(mapped))
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(expected).__name__ == settings["tokenizer_class"]
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
        "supported: BlenderbotTokenizer's and RobertaTokenizer's are, and a folder with "
        "tokenizer.json"
    )
