"""llama.cpp's pre-tokenizers for byte-pair-encoding GGUF vocabularies, by `tokenizer.ggml.pre`.

Facts read from llama.cpp's src/llama-vocab.cpp (the `tokenizer_pre` names in
`llama_vocab::impl::load`, the regexes in `llm_tokenizer_bpe`) and src/unicode.cpp (how it
runs them). Each regex set is applied in order, every match split off on its own, as the
`tokenizers` library's `Split(..., "isolated")` does. The regexes are llama.cpp's own strings,
except where llama.cpp does not run a string as a regex (see `_as_llama_cpp_runs_it`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from tokenizers import Regex, pre_tokenizers

SPM_SPACE = "\u2581"

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


def _words(upper: str, lower: str, tail: str = "") -> str:
    """Words of optional capitals then small letters, or capitals then optional small ones."""
    lead = r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{tail}|{lead}{upper}+{lower}*{tail}"


# Capitals and small letters told apart by ASCII only (llama.cpp's rewrite of \p{Lu}, \p{Ll}),
# or by Unicode category.
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_UPPER_M, _LOWER_M = r"((?=[\p{L}\p{M}])([^a-z]))", r"((?=[\p{L}\p{M}])([^A-Z]))"
_UNICODE_CASED = _words(
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", _CONTRACTIONS + "?"
)
_GPT4O_REST = r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PUNCT_WORDS = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
_DEEPSEEK3 = (  # with CR and LF themselves in it, not \r and \n, as in llama.cpp
    _PUNCT_WORDS + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # also most scripts from U+0800
_NORDIC = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_NEWLINES = r"[^\n]+|[\n]+"

# Regex sets, named after llama.cpp's LLAMA_VOCAB_PRE_TYPE_* that holds them.
REGEX_SETS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "jais2": (
        _LLAMA3.replace(
            r"|\s+(?!\S)|\s+",
            "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
            + r"|\s{1,2}(?!\S)|\s{1}",
        ),
    ),
    "qwen2": (_QWEN2,),
    "qwen35": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "minicpm5": (r"\p{N}{1,3}", _QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")),
    "deepseek-llm": (
        "[\r\n]",
        # Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee... letters
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
        "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
        "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
        "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
        "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
        "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
        "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
        "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
        "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
        "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
        "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _DEEPSEEK_CJK,
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"),
    "deepseek3-llm": (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3),
    "spark2_5": (
        r"\p{N}{1,3}",
        _CJK_KANA,
        _DEEPSEEK3.replace("+[\r\n]*|\\s*[\r\n]+|", "+|[\r\n]|"),
        r"\p{N}",
    ),
    "afmoe": (
        r"\p{AFMoE_digits}",
        # CJK (U+8C48 in llama.cpp's source, where U+F900 was meant), kana, Thai, Lao, Khmer,
        # Myanmar, Hangul
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
        "\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
        "\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        _PUNCT_WORDS + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "youtu": (
        # Hangul, CJK punctuation, Bopomofo, CJK and kana
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b"
        "\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,
        _UNICODE_CASED + _GPT4O_REST.replace(r"\p{N}{1,3}", r"\p{N}"),
    ),
    "tekken": (_words(_UPPER, _LOWER) + _GPT4O_REST.replace(r"\p{N}{1,3}", r"\p{N}"),),
    "gpt4o": (_words(_UPPER, _LOWER, _CONTRACTIONS + "?") + _GPT4O_REST,),
    "tiny_aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _UNICODE_CASED + _GPT4O_REST),
    "poro": (_NORDIC,),
    "viking": (_NORDIC, r"\p{N}"),
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ),
    "kimi-k2": (r"\p{Han}+",),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "ufakzeka": (_QWEN2.removeprefix(_CONTRACTIONS + "|"),),
    "laguna": (_NEWLINES, _QWEN2),
    "exaone-moe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "granite-emb-multi": (_words(_UPPER_M, _LOWER_M, _CONTRACTIONS + "?") + _GPT4O_REST,),
    "gemma4": (_NEWLINES,),
}


@dataclass(frozen=True)
class PreTokenizer:
    """What llama.cpp does for one `tokenizer.ggml.pre` value."""

    regex_set: str
    add_bos: bool = False  # BOS is added when the file does not say
    ignore_merges: bool = False  # a word that is a token is that token, unmerged
    # llama_detokenize()'s clean-up (" ." -> "."...); llmrun decodes as llama.cpp prints a
    # stream of pieces, without it, so that the pieces concatenate to the decode.
    clean_spaces: bool = True
    byte_level: bool = True  # GPT-2's byte alphabet; else raw UTF-8 and <0xXX> byte tokens
    escape_spaces: bool = False  # spaces become U+2581 before splitting
    bos_always: bool = False  # BOS is added even where the file says not to (Gemma 4)
    # llama.cpp's "whitespace" tokenizer model (WHITESPACE_MODEL): the text cut at
    # whitespace, which is dropped, each piece lowercased where `lowercase`.
    drop_whitespace: bool = False
    lowercase: bool = False
    # Gemma 4: a word of newlines that is a token is that token, unmerged (llama.cpp's
    # LLAMA_VOCAB_PRE_TYPE_GEMMA4 rule).
    newline_words: bool = False

    @property
    def regexes(self) -> tuple[str, ...]:
        return REGEX_SETS[self.regex_set] if self.regex_set else ()


_LLAMA3_FLAGS = dict(add_bos=True, ignore_merges=True)
_KEEP_SPACES = dict(clean_spaces=False)

# (values that share it, pre-tokenizer), in llama_vocab::impl::load's order.
_TABLE: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), PreTokenizer("default")),
    (("minicpm5",), PreTokenizer("minicpm5", ignore_merges=True)),
    (
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        PreTokenizer("llama3", **_LLAMA3_FLAGS),
    ),
    (("deepseek-llm",), PreTokenizer("deepseek-llm", **_KEEP_SPACES)),
    (("deepseek-coder",), PreTokenizer("deepseek-coder", **_KEEP_SPACES)),
    (
        ("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"),
        PreTokenizer("deepseek3-llm", **_KEEP_SPACES),
    ),
    (("spark2_5",), PreTokenizer("spark2_5", **_KEEP_SPACES)),
    (("youtu",), PreTokenizer("youtu", ignore_merges=True, **_KEEP_SPACES)),
    (("falcon",), PreTokenizer("falcon")),
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
        ),
        PreTokenizer("gpt2"),
    ),
    (("trillion", "granite-docling"), PreTokenizer("gpt2", **_KEEP_SPACES)),
    (
        ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"),
        PreTokenizer("starcoder"),
    ),
    (("command-r", "smollm"), PreTokenizer("starcoder", **_KEEP_SPACES)),
    (("jais-2",), PreTokenizer("jais2")),
    (
        ("gemma4", "granite-embed-multi-311m"),
        PreTokenizer(
            "gemma4", byte_level=False, escape_spaces=True, bos_always=True, newline_words=True
        ),
    ),
    (
        ("sarvam-moe",),
        PreTokenizer("gemma4", byte_level=False, escape_spaces=True, **_KEEP_SPACES),
    ),
    (
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"),
        PreTokenizer("qwen2", **_KEEP_SPACES),
    ),
    (("stablelm2", "megrez"), PreTokenizer("qwen2")),
    (("qwen35",), PreTokenizer("qwen35", **_KEEP_SPACES)),
    # llama.cpp's DBRX, SMAUG and CHATGLM4 regexes are Llama 3's, without its flags.
    (("dbrx", "smaug-bpe", "chatglm-bpe"), PreTokenizer("llama3")),
    (("glm4", "glm5"), PreTokenizer("llama3", ignore_merges=True)),
    (("poro-chat",), PreTokenizer("poro", **_KEEP_SPACES)),
    (("bloom", "gpt3-finnish"), PreTokenizer("poro")),
    (("viking",), PreTokenizer("viking", **_KEEP_SPACES)),
    (("tekken",), PreTokenizer("tekken", **_LLAMA3_FLAGS, **_KEEP_SPACES)),
    (("exaone-moe",), PreTokenizer("exaone-moe")),
    (("chameleon",), PreTokenizer("chameleon", add_bos=True, **_KEEP_SPACES)),
    (
        ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
        PreTokenizer("gpt4o", **_KEEP_SPACES),
    ),
    (
        ("granite-embed-multi-97m",),
        PreTokenizer("granite-emb-multi", ignore_merges=True, **_KEEP_SPACES),
    ),
    (("tiny_aya", "cohere2moe"), PreTokenizer("tiny_aya", **_KEEP_SPACES)),
    (("superbpe",), PreTokenizer("superbpe", **_KEEP_SPACES)),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer("bailingmoe", **_KEEP_SPACES)),
    (("seed-coder",), PreTokenizer("seed-coder", **_KEEP_SPACES)),
    (("kimi-k2",), PreTokenizer("kimi-k2", **_KEEP_SPACES)),
    (("ufakzeka",), PreTokenizer("ufakzeka", **_KEEP_SPACES)),
    (("afmoe",), PreTokenizer("afmoe", **_KEEP_SPACES)),
    (("laguna",), PreTokenizer("laguna", **_KEEP_SPACES)),
]

PRE_TOKENIZERS: dict[str, PreTokenizer] = {v: pre for values, pre in _TABLE for v in values}

# llama.cpp's "whitespace" tokenizer model (jina-embeddings-v2-base-zh; conversion/base.py
# _set_vocab_whitespace, llm_tokenizer_whitespace_session): byte-pair encoding over raw text
# (<0xXX> tokens for bytes), on each run between whitespace characters, which are dropped;
# its pre value, "whitespace" (\S+), cuts such a run no further. The file's
# tokenizer.ggml.normalizer.lowercase says whether the runs are lowercased.
WHITESPACE_MODEL = PreTokenizer("", byte_level=False, drop_whitespace=True)
# Not llama.cpp's: "jina-v2-zh", which forks carrying its unmerged pull request #7795 wrote
# for jina-embeddings-v2-base-zh (tokenizer model "gpt2", the vocabulary as raw text, no
# lowercase key): the same tokenizer, lowercased, as the model's tokenizer.json is.
FORK_PRE_TOKENIZERS = {"jina-v2-zh": replace(WHITESPACE_MODEL, lowercase=True)}
# What llama.cpp calls whitespace (unicode_set_whitespace: Unicode's White_Space).
WHITESPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


# Digit runs in threes from the right (1234567: 1 234 567), as llama.cpp's own code splits
# them: the text before a run goes with its first group. \G (where the last match ended)
# keeps the search linear.
_DIGITS_IN_THREES = r"\G\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
# unicode_cpt_is_han(): the CJK ideograph blocks, not all of Unicode's Han script.
_HAN = (
    r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2EBEF}"
    r"\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}"
)
# Strings llama.cpp does not run as regexes, but as code of its own (unicode_regex_split_custom).
_RUN_AS_CODE = {
    r"\p{AFMoE_digits}": _DIGITS_IN_THREES,
    r"\d{1,3}(?=(?:\d{3})*\b)": _DIGITS_IN_THREES,
    # Kimi K2's whole regex, with words of non-Han letters (no marks), any-case contractions.
    r"\p{Han}+": (
        rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_CONTRACTIONS}?|\p{{N}}{{1,3}}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}


# The code points Unicode 16.0 assigned (DerivedAge.txt). llama.cpp's character tables are
# Unicode 15.1's, in which they are unassigned: in no \p{..} class. The tokenizers library's
# Oniguruma knows 16.0 (U+105C0, a Todhri letter, is \p{L} there).
_UNICODE_16 = (
    r"\x{0897}\x{1B4E}-\x{1B4F}\x{1B7F}\x{1C89}-\x{1C8A}\x{2427}-\x{2429}\x{31E4}-\x{31E5}"
    r"\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D40}-\x{10D65}"
    r"\x{10D69}-\x{10D85}\x{10D8E}-\x{10D8F}\x{10EC2}-\x{10EC4}\x{10EFC}\x{11380}-\x{11389}"
    r"\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}-\x{113C0}\x{113C2}\x{113C5}"
    r"\x{113C7}-\x{113CA}\x{113CC}-\x{113D5}\x{113D7}-\x{113D8}\x{113E1}-\x{113E2}"
    r"\x{116D0}-\x{116E3}\x{11BC0}-\x{11BE1}\x{11BF0}-\x{11BF9}\x{11F5A}\x{13460}-\x{143FA}"
    r"\x{16100}-\x{16139}\x{16D40}-\x{16D79}\x{18CFF}\x{1CC00}-\x{1CCF9}\x{1CD00}-\x{1CEB3}"
    r"\x{1E5D0}-\x{1E5FA}\x{1E5FF}\x{1F8B2}-\x{1F8BB}\x{1F8C0}-\x{1F8C1}\x{1FA89}\x{1FA8F}"
    r"\x{1FABE}\x{1FAC6}\x{1FADC}\x{1FADF}\x{1FAE9}\x{1FBCB}-\x{1FBEF}"
)


def _as_llama_cpp_runs_it(regex: str) -> str:
    """The regex for `tokenizers` (Oniguruma) that splits text as llama.cpp does with `regex`."""
    regex = _as_written_for_oniguruma(regex)
    # Each category as llama.cpp's Unicode 15.1 tables have it.
    regex = re.sub(r"\\P\{(\w)\}", r"[^\\p{\1}]", regex)
    return re.sub(r"\\p\{\w\}", lambda m: f"[{m[0]}&&[^{_UNICODE_16}]]", regex)


def _as_written_for_oniguruma(regex: str) -> str:
    """`regex` as Oniguruma must have it to match what llama.cpp's regex engine does."""
    if regex in _RUN_AS_CODE:
        return _RUN_AS_CODE[regex]
    # llama.cpp matches \p{..} on a copy of the text in which each character stands for its
    # general category, and letters of every case are one category there.
    regex = re.sub(r"\\p\{L[ultmo]\}", r"\\p{L}", regex)
    # std::regex's \d is ASCII; Oniguruma's is any decimal digit.
    regex = regex.replace(r"\d", "[0-9]")
    if regex.isascii():
        return regex
    # Before a regex with characters beyond ASCII sees the text, llama.cpp turns each space
    # beyond ASCII (U+3000...) into \v, which none of its classes of such characters holds.
    return re.sub(r"\[(?!\^)((?:[^\]\\]|\\.)*[^\x00-\x7f](?:[^\]\\]|\\.)*)\]", r"[\1&&\\S]", regex)


def pre_tokenizer(pre: PreTokenizer, absent: str = "") -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer that splits text as llama.cpp does, then maps bytes to
    GPT-2's alphabet where the vocabulary is byte-level. `absent`: the characters of that
    alphabet that the vocabulary has no token for."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(_as_llama_cpp_runs_it(r)), "isolated") for r in pre.regexes
    ]
    if pre.drop_whitespace:
        steps.insert(0, pre_tokenizers.Split(Regex(f"[{WHITESPACE}]+"), "removed"))
    if pre.byte_level:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        if absent:
            # llama.cpp keeps a character without a token in its word, where no merge takes
            # it, and drops it at the end; the tokenizers library drops it before merging,
            # which lets its neighbours merge. Cutting the word there, without it, is
            # llama.cpp's way.
            steps.append(pre_tokenizers.Split(Regex(f"[{re.escape(absent)}]"), "removed"))
    return pre_tokenizers.Sequence(steps)
