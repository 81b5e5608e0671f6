"""llama.cpp's pre-tokenizers, one regex set at a time: the table holds what llama.cpp's source
says, each set splits text exactly as llama.cpp's own unicode_regex_split() does, and where
the model family's tokenizer.json splits otherwise, only where llama.cpp is known to."""

import difflib
import json
import re
import tarfile
from pathlib import Path

import pytest
from gguf import Keys
from tokenizers import Regex, pre_tokenizers

from llmrun.errors import UnsupportedError
from llmrun.pretokenizers import PRE_TOKENIZERS, REGEX_SETS, PreTokenizer, pre_tokenizer
from llmrun.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
SPLITS = json.loads((HERE / "llama_cpp_splits.json").read_text())
SAMPLE = SPLITS["texts"][0]
SDIST = HERE.parent / "data" / "cache" / "downloads" / "llama_cpp_python-0.3.36.tar.gz"
VOCAB_CPP = "llama_cpp_python-0.3.36/vendor/llama.cpp/src/llama-vocab.cpp"

_C = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CASED = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _C + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _C + "?"
)
_GPT4O_REST = r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# The families' tokenizer.json regexes, where llama.cpp rewrote them (its comments quote them;
# GPT-2's is the tokenizers ByteLevel one). Other sets are llama.cpp's strings unchanged.
TOKENIZER_JSON = {
    "gpt2": (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",),
    "llama3": (
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "qwen2": (
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen35": (
        _C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "gpt4o": (_CASED + _GPT4O_REST,),
    "tiny_aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _CASED + _GPT4O_REST),
    "bailingmoe": (
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _C + "|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\r\n]+|\\s*[\r\n]+"
        "|\\s+(?!\\S)|\\s+",
    ),
    "exaone-moe": (
        _C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "minicpm5": (
        r"\p{N}{1,3}",
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    # Kimi K2's tokenization_kimi.py
    "kimi-k2": (
        r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+" + _C + r"?|[^\r\n\p{L}\p{N}]?"
        r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        + _C
        + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
# Where llama.cpp (so llmrun) splits SAMPLE otherwise than the family's tokenizer.json, as
# (llama.cpp's pieces, tokenizer.json's pieces):
# capitals are letters like any other where llama.cpp reads \p{Lu}, \p{Ll}...,
_CAMEL = ([" HelloWorld", " helloWORLD"], [" Hello", "World", " hello", "WORLD"])
_GREEK = ([" \u0391\u03b2\u03b3\u0394\u03b5\u03b6"], [" \u0391\u03b2\u03b3", "\u0394\u03b5\u03b6"])
# or only ASCII letters have a case (its rewrite of Tekken's and GPT-4o's regexes),
_ASCII_CASE = ([" \u00c9", "COLE"], [" \u00c9COLE"])
# and combining marks are no part of a word there,
_MARKS = ([" cafe", "\u0301"], [" cafe\u0301"])
_INDIC = (
    ["\u0939", "\u093f\u0928", "\u094d\u0926", "\u0940", " \u09ac", "\u09be\u0982", "\u09b2"]
    + ["\u09be", " \u0c24", "\u0c46\u0c32", "\u0c41\u0c17", "\u0c41"],
    ["\u0939\u093f\u0928\u094d\u0926\u0940", " \u09ac\u09be\u0982\u09b2\u09be"]
    + [" \u0c24\u0c46\u0c32\u0c41\u0c17\u0c41"],
)
# nor U+3005 of a Han word for Kimi K2 (not in llama.cpp's Han blocks), and U+3000 is a space,
# not one of the CJK punctuation marks, for DeepSeek's classes of them.
_SPACE = (["\u3000ideographic"], ["\u3000", "ideographic"])
KNOWN_DIFFERENCES = {
    "deepseek-llm": [_SPACE],
    "deepseek-coder": [_SPACE],
    "youtu": [_CAMEL, _GREEK],
    "tiny_aya": [_CAMEL, _GREEK],
    "tekken": [_ASCII_CASE, _GREEK, _MARKS, _INDIC],
    "gpt4o": [_ASCII_CASE, _GREEK, _MARKS, _INDIC],
    "kimi-k2": [_CAMEL, _GREEK, (["\u3007", "\u3005"], ["\u3007\u3005"]), _MARKS, _INDIC],
}


def split(regexes, text: str) -> list[str]:
    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in regexes])
    return [piece for piece, _ in seq.pre_tokenize_str(text)]


def llmrun_split(name: str, text: str) -> list[str]:
    """llmrun's split, before the byte-level step (which moves no boundaries)."""
    pre = PreTokenizer(name, byte_level=False)
    return [piece for piece, _ in pre_tokenizer(pre).pre_tokenize_str(text)]


def pieces(text: str, lengths: list[int]) -> list[str]:
    out, start = [], 0
    for n in lengths:
        out.append(text[start : start + n])
        start += n
    assert start == len(text)
    return out


@pytest.mark.parametrize("name", sorted(REGEX_SETS))
def test_splits_as_llama_cpp_does(name):
    for text, lengths in zip(SPLITS["texts"], SPLITS["piece_lengths"][name], strict=True):
        assert llmrun_split(name, text) == pieces(text, lengths), repr(text)


@pytest.mark.parametrize("name", sorted(set(REGEX_SETS) - {"afmoe"}))  # no regex for its digits
def test_splits_as_the_family_tokenizer_json_but_where_llama_cpp_differs(name):
    ours = llmrun_split(name, SAMPLE)
    theirs = split(TOKENIZER_JSON.get(name, REGEX_SETS[name]), SAMPLE)
    diff = difflib.SequenceMatcher(a=ours, b=theirs, autojunk=False).get_opcodes()
    found = [(ours[i1:i2], theirs[j1:j2]) for op, i1, i2, j1, j2 in diff if op != "equal"]
    assert found == [(list(a), list(b)) for a, b in KNOWN_DIFFERENCES.get(name, [])]


def test_sample_has_what_the_issue_asks_for():
    for needle in ("def f(x):", "1234567", "\u65e5\u672c", "\U0001f600", "'re", "\n\n", "\t\t"):
        assert needle in SAMPLE


_UNESCAPE = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"'}


def _llama_cpp_facts(source: str) -> tuple[dict, dict]:
    """{pre type: (regexes, byte-level)}, {pre value: (pre type, flags)} from llama-vocab.cpp."""
    switch = source[source.index("struct llm_tokenizer_bpe : llm_tokenizer {") :]
    switch = switch[: switch.index("std::vector<std::string> regex_exprs;")]
    sets = {}
    for case in switch.split("break;"):
        kinds = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", case) + ["DEFAULT"] * (
            "default:" in case
        )
        body = re.search(r"regex_exprs = \{(.*?)\};", case, re.S)
        if not kinds or body is None:
            continue
        code = [line.strip() for line in body.group(1).splitlines()]
        literals = [re.findall(r'"((?:[^"\\]|\\.)*)"', line) for line in code if line[:1] == '"']
        regexes = [re.sub(r"\\(.)", lambda e: _UNESCAPE[e.group(1)], lit[0]) for lit in literals]
        for kind in kinds:
            sets[kind] = (regexes, "byte_encode = false" not in case)
    load = source[source.index('} else if (tokenizer_pre == "default") {') :]
    load = load[: load.index("} else if (type == LLAMA_VOCAB_TYPE_SPM) {")]
    values = {}
    for block in load.split("} else if (")[1:]:
        kind = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", block).group(1)
        flags = dict(re.findall(r"\n\s+(\w+) = (true|false);", block))
        for value in re.findall(r'tokenizer_pre == "([^"]+)"', block.split("{")[0]):
            values[value] = (kind, flags)
    return sets, values


@pytest.mark.skipif(not SDIST.is_file(), reason=f"{SDIST.name} is absent: run tests/data/fetch.py")
def test_table_holds_every_value_llama_cpp_knows_with_its_regexes_and_flags():
    with tarfile.open(SDIST) as tar:
        source = tar.extractfile(VOCAB_CPP).read().decode()
    sets, values = _llama_cpp_facts(source)
    assert len(sets) > 50 and len(values) > 90
    # "whitespace" goes with llama.cpp's "whitespace" tokenizer model, not "gpt2".
    assert set(PRE_TOKENIZERS) == set(values) - {"whitespace"}
    for value, pre in PRE_TOKENIZERS.items():
        kind, flags = values[value]
        regexes, byte_level = sets[kind]
        assert list(pre.regexes) == regexes, value
        assert pre.add_bos == (flags.get("add_bos") == "true"), value
        assert pre.ignore_merges == (flags.get("ignore_merges") == "true"), value
        assert pre.clean_spaces == (flags.get("clean_spaces") != "false"), value
        assert pre.escape_spaces == (flags.get("escape_whitespaces") == "true"), value
        assert pre.byte_level == byte_level, value


def tiny(pre: str | None, **changes) -> Tokenizer:
    # "abc" is a token that no merge makes.
    meta = {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.LIST: ["a", "b", "c", "ab", "abc", "<s>"],
        Keys.Tokenizer.TOKEN_TYPE: [1, 1, 1, 1, 1, 3],
        Keys.Tokenizer.MERGES: ["a b"],
        Keys.Tokenizer.BOS_ID: 5,
    }
    if pre is not None:
        meta[Keys.Tokenizer.PRE] = pre
    meta.update(changes)
    return Tokenizer.from_gguf_metadata(meta, "tiny.gguf")


@pytest.mark.parametrize(
    ("pre", "ids"),
    [("llama-bpe", [4]), ("glm4", [4]), ("tekken", [4]), ("dbrx", [3, 2]), ("qwen2", [3, 2])],
)
def test_ignore_merges_takes_a_word_found_in_the_vocabulary_whole(pre, ids):
    assert tiny(pre).encode("abc", add_bos=False) == ids


@pytest.mark.parametrize(
    ("pre", "add_bos"),
    [("llama3", True), ("tekken", True), ("chameleon", True), ("dbrx", False), ("gpt-4o", False)],
)
def test_bos_default_follows_the_pre_tokenizer_and_the_file_wins(pre, add_bos):
    assert tiny(pre).add_bos is add_bos
    assert tiny(pre, **{Keys.Tokenizer.ADD_BOS: not add_bos}).add_bos is not add_bos


def test_no_pre_tokenizer_is_llama_cpp_default():
    assert tiny(None).encode("abc") == tiny("").encode("abc") == tiny("default").encode("abc")
    assert tiny(None).encode("abc") == [3, 2]


def test_unknown_pre_tokenizer_names_value_and_file():
    with pytest.raises(UnsupportedError, match=r"^tiny.gguf: .*'mystery' is not supported"):
        tiny("mystery")
    with pytest.raises(UnsupportedError, match="'whitespace' is not supported"):
        tiny("whitespace")


def test_gemma4_model_reads_no_pre_value_and_always_adds_bos():
    meta = {
        Keys.Tokenizer.MODEL: "gemma4",
        Keys.Tokenizer.PRE: "mystery",
        Keys.Tokenizer.LIST: ["<bos>", "\u2581", "a", "\u2581a", "\n", "<0x41>"],
        Keys.Tokenizer.TOKEN_TYPE: [3, 1, 1, 1, 1, 6],
        Keys.Tokenizer.MERGES: ["\u2581 a"],
        Keys.Tokenizer.BOS_ID: 0,
        Keys.Tokenizer.ADD_BOS: False,
    }
    tok = Tokenizer.from_gguf_metadata(meta, "gemma.gguf")
    assert tok.add_bos is True
    sarvam = {**meta, Keys.Tokenizer.MODEL: "gpt2", Keys.Tokenizer.PRE: "sarvam-moe"}
    assert Tokenizer.from_gguf_metadata(sarvam, "sarvam.gguf").add_bos is False
    assert tok.encode(" a\nA") == [0, 3, 4, 5]  # spaces as U+2581, "A" by its byte token
    assert tok.decode([0, 3, 4, 5]) == " a\nA"
