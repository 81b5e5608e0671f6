"""The RWKV world tokenizer (llmrun/rwkv_tokenizer.py) of a GGUF written by llama.cpp's
converter from the world vocabulary file: BlinkDL's TRIE_TOKENIZER's ids on varied text,
llama.cpp's where the two differ (the file's control and filler tokens, which llama.cpp's
trie holds), decodes that give the text back, and llama.cpp's "rwkv-world" chat template."""

import pytest
from helpers import needs_converter
from rwkv_helpers import VOCAB_FILE, converted

from llmrun.api import load
from llmrun.chat_template import NAMED_TEMPLATES, ChatTemplate
from llmrun.rwkv_tokenizer import unescape
from llmrun.tokenizer import load_tokenizer

TRIE_TOKENIZER = pytest.importorskip("rwkv.rwkv_tokenizer").TRIE_TOKENIZER
pytestmark = needs_converter

TEXTS = [
    "Hello world!",
    "  leading spaces\n\nand\ttabs\r\n",
    "中文汉字，日本語のテキスト、한국어",
    "emoji 🤗🚀👍🏽 family 👨\u200d👩\u200d👧",
    "def f(x):\n    return x**2  # code\n\tpass\n",
    "Ünïcödé ñ ß ø — “quotes” ‘single’",
    "\\x00 \\n backslash \\\\ 'single' \"double\" '\"",
    "User: hi\n\nAssistant: <think>\n</think>",
]
# llama-cpp-python 0.3.36 (llama_tokenize, vocab_only) on the converter's file, both with
# and without special tokens parsed: its trie holds "<s>" (id 0) and the [PADn] fillers.
LLAMA_CPP_IDS = {"a<s>b": [98, 0, 99], "x<s>": [121, 0], "[PAD65533]": [65533]}
# llama_chat_apply_template("rwkv-world", ..., add_ass=true) of MESSAGES.
MESSAGES = [
    {"role": "system", "content": " Be nice "},
    {"role": "user", "content": "hi\n"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "How?"},
]
LLAMA_CPP_CHAT = "System: Be nice\n\nUser: hi\n\nAssistant: Hello!\n\nUser: How?\n\nAssistant:"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return converted(tmp_path_factory)["f32"]


def test_ids_are_the_trie_tokenizers_and_llama_cpps(path):
    tokenizer = load_tokenizer(path)
    reference = TRIE_TOKENIZER(str(VOCAB_FILE))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
    for text, ids in LLAMA_CPP_IDS.items():
        assert tokenizer.encode(text, parse_special=False) == ids
        assert tokenizer.encode(text, parse_special=True) == ids
    # llama.cpp's RWKV: no BOS added; bos = eos = 0 and "\n\n" (261) ends a turn
    assert tokenizer.encode("hi") == [1922]
    assert tokenizer.eog_ids == {0, 261}


def test_token_texts_unescape_as_llama_cpp_reads_them():
    assert unescape("\\n\\t\\r") == b"\n\t\r"
    assert unescape("\\xe4\\xb8") == b"\xe4\xb8"
    assert unescape("\\\\ \\' plain") == b"\\ ' plain"


def test_the_named_rwkv_world_template_renders_as_llama_cpp(path):
    assert ChatTemplate(NAMED_TEMPLATES["rwkv-world"]).render(MESSAGES) == LLAMA_CPP_CHAT
    engine = load(str(path), device="cpu")
    assert engine.template.render(MESSAGES) == LLAMA_CPP_CHAT
