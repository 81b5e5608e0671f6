"""GPT-NeoX Japanese's tokenizer (llmrun/gpt_neox_japanese_tokenizer.py) against
transformers' GPTNeoXJapaneseTokenizer on a small vocab.txt and emoji.json written here
(the Hub's abeja/gpt-neox-japanese-2.7b files cannot be fetched in tests) that holds what
the real ones do: spellings sharing an id (慶応,慶應), tags (<SP>, <BR>, <TAB>, <BLOCK>,
<KIGOU>, <U2000U2BFF>), emoji tags, the 256 byte tokens and the special tokens, and
tokens longer than the 3 characters matched away from a "<".

Ids equal transformers' on texts that exercise each rule and on 2,000 random texts from
an alphabet of the vocabulary's characters, others (byte tokens), emoji, spaces, breaks
and tabs; decodes equal transformers' except where it differs on purpose (a character
in byte tokens decoded whole, the text's ends not stripped). `llmrun run` on a tiny
GPT-NeoX Japanese folder with these files picks transformers' greedy ids for a Japanese
prompt, and `llmrun show` names the tokenizer.
"""

import json
import random

import pytest
import torch
from helpers import randomize, save_hf_dir
from in_process import llmrun

from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

WORDS = [
    "吾輩", "吾", "輩", "は", "猫", "で", "ある", "あ", "る", "。", "実", "慶応,慶應", "大学",
    "大", "学", "出身", "出", "身", "(", ")", "日本", "日本語", "語", "の", "が", "で使",
    "使", "え", "ます", "G", "P", "T", "GPT", "-", "ne", "o", "x", "n", "e", "a", "b",
    "c", "ab", "abc", "Hu", "gg", "ing", "Fa", "ce", "H", "u", "g", "i", "F", "ー", "1",
    "2", "12", "123", "<", ">", "<a", "x,y", "東京", "東", "京", "都", "東京都庁舎",
    "<SP>", "<BR>", "<TAB>", "<BLOCK>", "<KIGOU>", "<U2000U2BFF>",
]  # fmt: skip
EMOJI = {"😀": "<|emoji1|>", "🐯": "<|emoji2|>", "❤": "<|emoji3|>"}
TEXTS = [
    "吾輩は猫である🐯。実は慶応(慶應)大学出身",
    "日本語のGPT-neoxがHugging Faceで使えます😀",
    "a b\tc\n\r\nabc—x−y 東京都庁舎 東京都<|endoftext|>x<a>",
    "‖ ¡ ✓ é ñ 字　全角",  # <U2000U2BFF>, <KIGOU>, bytes, an ideographic space
    "<|startoftext|>日本<|endoftext|>",
]


def write_tokenizer(folder, do_clean_text=False):
    """vocab.txt (WORDS, emoji tags, bytes, <|startoftext|>, <|endoftext|>), emoji.json
    and tokenizer_config.json into `folder`; returns the vocabulary's size."""
    lines = WORDS + list(EMOJI.values()) + [f"<|byte{i}|>" for i in range(256)]
    lines += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    emoji = {"emoji": EMOJI, "emoji_inv": {tag: char for char, tag in EMOJI.items()}}
    (folder / "emoji.json").write_text(json.dumps(emoji), encoding="utf-8")
    config = {"tokenizer_class": "GPTNeoXJapaneseTokenizer", "do_clean_text": do_clean_text}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(lines)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-neox-japanese")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    return transformers.GPTNeoXJapaneseTokenizer(
        vocab_file=str(folder / "vocab.txt"), emoji_file=str(folder / "emoji.json")
    )


def random_texts(count: int) -> list[str]:
    alphabet = list("吾輩は猫である。実慶応應大学出身()日本語のがで使えますGPTnexoabcyHgFiu")
    alphabet += list("ー12<>東京都庁舎😀🐯❤—−¡é✓‖字ñ") + [" ", "\u3000", "\n", "\r\n", "\t"]
    rng = random.Random(0)
    return ["".join(rng.choices(alphabet, k=rng.randint(0, 24))) for _ in range(count)]


def test_ids_equal_transformers(folder, reference):
    tokenizer = load_tokenizer(folder)
    for text in TEXTS + random_texts(2000):
        assert tokenizer.encode(text) == reference(text)["input_ids"], text


def test_decodes_equal_transformers_but_keep_characters_and_ends_whole(folder, reference):
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode(TEXTS[0])
    assert (
        tokenizer.decode(ids) == reference.decode(ids) == "吾輩は猫である🐯。実は慶応(慶応)大学出身"
    )
    ids = tokenizer.encode(" 字é ")
    assert reference.decode(ids) == "\ufffd" * 5  # each of the 5 byte tokens alone
    assert tokenizer.decode(ids) == " 字é "
    pieces = [tokenizer.stream().add(i) for i in tokenizer.encode("東京😀\n")]
    assert "".join(pieces) == "東京😀\n"
    assert tokenizer.eos_id == reference.eos_token_id
    assert tokenizer.decode(tokenizer.encode("都<|endoftext|>")) == "都"


def test_do_clean_text_is_refused(tmp_path):
    write_tokenizer(tmp_path, do_clean_text=True)
    result = llmrun("tokenize", str(tmp_path), "日本")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "do_clean_text" in result.stderr


def test_run_picks_transformers_greedy_ids_for_a_japanese_prompt(folder, reference, tmp_path):
    model = tmp_path / "gpt-neox-japanese-tiny"
    model.mkdir()
    vocab = write_tokenizer(model)
    config = dict(
        model_type="gpt_neox_japanese",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_multiple_size=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        bos_token_id=vocab - 2,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32
    ).eval()
    randomize(hf)
    save_hf_dir(hf, model)
    prompt = "吾輩は猫である。東京都"
    ids = reference(prompt)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    result = llmrun(
        "run", str(model), prompt, "-n", "8", "--temperature", "0", "--json", "--logprobs", "1"
    )
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
    shown = llmrun("show", str(model))
    assert shown.returncode == 0, shown.stderr
    assert "GPT-NeoX Japanese (vocab.txt)" in shown.stdout
