"""jina-embeddings-v2-base-zh's vocabulary as GGUFs hold it, against the `tokenizers` library
running a tokenizer.json of the model's kind: byte-pair encoding over raw text (no byte-level
alphabet), a Lowercase normalizer and the Whitespace pre-tokenizer, trained here on mixed
Chinese and English with the whitespace characters in its alphabet (as the model's
vocabulary holds them).

Two layouts: llama.cpp's converter's (conversion/base.py _set_vocab_whitespace: tokenizer
model "whitespace", pre "whitespace", tokenizer.ggml.normalizer.lowercase from the Lowercase
normalizer), which llama.cpp tokenizes by cutting the text at whitespace (dropped), lowercasing
and merging each piece; and model "gpt2" with pre "jina-v2-zh", the files of forks that carried
llama.cpp's unmerged pull request #7795 for the model. Both give the library's ids for text
the vocabulary covers. Where a character has no token, the library gives <unk>, llama.cpp
nothing (the one known difference, asserted).
"""

import json

import pytest
from gguf import Keys, TokenType
from tokenizers import Tokenizer as Backend
from tokenizers import normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from llmrun.tokenizer import Tokenizer
from llmrun.wordpiece import LOWERCASE_KEY

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
CORPUS = [
    "您的查询可以是中文，也可以是英文。",
    "Your query can be in Chinese or in English, and the answer too!",
    "北京是中国的首都，上海是最大的城市。",
    "Jina Embeddings v2 handles 8192 tokens of text.",
    "深度学习模型 processes long documents quickly.",
    "How are you? 我很好，谢谢！ snake_case_names",
]
TEXTS = [
    "您的查询可以是中文",
    "Your Query CAN be in CHINESE, or English!",
    "  leading\tand\ntrailing  whitespace \u3000北京\u3000",
    "北京是中国的首都。How ARE you?",
    "8192 tokens_of text",
    "",
    " \n\t ",
]


def train() -> Backend:
    """The model's kind of tokenizer, trained on CORPUS."""
    backend = Backend(BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=[" ", "\t", "\n", "\u3000"]
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    return backend


@pytest.fixture(scope="module")
def trained() -> Backend:
    return train()


def metadata(backend: Backend, model: str, pre: str, lowercase: bool | None) -> dict:
    """The tokenizer metadata the converter writes of `backend` (tokens as their text, the
    special ones control, the merges, <s> and </s> around a text)."""
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL for t in tokens]
    merges = [" ".join(m) for m in _merges(backend)]
    out = {
        Keys.Tokenizer.MODEL: model,
        Keys.Tokenizer.PRE: pre,
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.TOKEN_TYPE: [int(t) for t in types],
        Keys.Tokenizer.MERGES: merges,
        Keys.Tokenizer.BOS_ID: vocab["<s>"],
        Keys.Tokenizer.EOS_ID: vocab["</s>"],
        Keys.Tokenizer.UNK_ID: vocab["<unk>"],
        Keys.Tokenizer.ADD_BOS: True,
        Keys.Tokenizer.ADD_EOS: True,
    }
    if lowercase is not None:
        out[LOWERCASE_KEY] = lowercase
    return out


def _merges(backend: Backend) -> list[tuple[str, str]]:
    merges = json.loads(backend.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


LAYOUTS = {  # name -> (tokenizer model, pre-tokenizer, normalizer.lowercase key)
    "llama.cpp": ("whitespace", "whitespace", True),
    "jina-v2-zh": ("gpt2", "jina-v2-zh", None),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_vocabulary_encodes_as_the_library(trained, layout):
    ours = Tokenizer.from_gguf_metadata(metadata(trained, *LAYOUTS[layout]), f"{layout}.gguf")
    for text in TEXTS:
        expected = trained.encode(text, add_special_tokens=False).ids
        assert trained.token_to_id("<unk>") not in expected, text
        assert ours.encode(text, add_bos=False, parse_special=False) == expected, text
    bos, eos = trained.token_to_id("<s>"), trained.token_to_id("</s>")
    ids = trained.encode(TEXTS[0], add_special_tokens=False).ids
    assert ours.encode_sequence(TEXTS[0]) == [bos, *ids, eos]


def test_what_each_rule_changes(trained):
    """Without lowercasing (the file's key false) capitals tokenize otherwise; whitespace has
    tokens of its own here, which llama.cpp drops; a character without a token is dropped,
    where the library gives <unk>."""
    unlowered = metadata(trained, "whitespace", "whitespace", False)
    ours = Tokenizer.from_gguf_metadata(unlowered, "x.gguf")
    text = TEXTS[1]
    assert ours.encode(text, add_bos=False) != trained.encode(text, add_special_tokens=False).ids
    assert trained.token_to_id(" ") is not None and trained.token_to_id("\t") is not None
    ours = Tokenizer.from_gguf_metadata(metadata(trained, *LAYOUTS["llama.cpp"]), "x.gguf")
    unk = trained.token_to_id("<unk>")
    assert trained.encode("北京 ☃", add_special_tokens=False).ids[-1] == unk
    assert (
        ours.encode("北京 ☃", add_bos=False) == trained.encode("北京", add_special_tokens=False).ids
    )
