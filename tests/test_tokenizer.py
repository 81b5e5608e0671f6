"""Tokenizers built from GGUF metadata reproduce llama.cpp's ids on real vocabularies, agree
with tokenizer.json, and stream pieces that concatenate to the full decode."""

import functools
import heapq
import json
import random
import shutil
import subprocess
import sys

import pytest
from gguf import Keys
from helpers import STORIES_GGUF, STORIES_HF, VOCAB_DIR
from in_process import llmrun
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.tokenizer import Tokenizer, load_tokenizer

# Every vocabulary of llama.cpp's test set that comes with reference tokenizations.
REFERENCE_VOCABS = sorted(
    p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
    for p in VOCAB_DIR.glob("ggml-vocab-*.gguf.inp")
    if p.with_suffix(".out").is_file() and p.with_suffix("").is_file()
)
# llama.cpp tokenizer models llmrun does not build (the tests of their vocabularies skip).
UNSUPPORTED_MODELS: dict[str, str] = {}  # tokenizer models llama.cpp has and llmrun lacks
FETCH = "run python tests/data/fetch.py"

needs_stories = pytest.mark.skipif(not STORIES_HF.is_dir(), reason=f"{STORIES_HF} is absent")

# Varied text that starts with no space (see test_gguf_space_prefix_follows_llama_cpp).
TEXTS = [
    "Once upon a time",
    "Hello  world\n\n  tabs\there, and   runs of    spaces   ",
    "日本語のテキスト and 中文 mixed",
    "emoji 😀👍🏽 and a family 👨\u200d👩\u200d👧 ok",
    "Ünïcödé ßtraße — “quotes” ‘too’",
    "line1\nline2\r\nline3\n",
    "numbers 3.14159 and 1,000,000!",
    "x",
]


@functools.cache
def vocab(name: str) -> Tokenizer:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp's {path.name} is not in {VOCAB_DIR}: {FETCH}")
    return load_tokenizer(path)


@functools.cache
def stories_gguf() -> Tokenizer:
    return load_tokenizer(STORIES_GGUF)


def reference_cases(name: str) -> list[tuple[str, list[int]]]:
    """The test strings and their ids, read as llama.cpp's test-tokenizer-0 reads them."""
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    # Bytes, not read_text: its newline translation would change texts with "\r".
    texts = path.with_suffix(".gguf.inp").read_bytes().decode().split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":  # after the last separator
        texts.pop()
    lines = path.with_suffix(".gguf.out").read_bytes().decode().splitlines()
    assert len(texts) == len(lines)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


def tokenizer_model(name: str) -> str:
    from llmrun.loading.gguf_io import read_gguf

    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    return read_gguf(path, with_tensors=False).metadata[Keys.Tokenizer.MODEL]


def streamed(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    decoder = tok.stream(**kwargs)
    return [decoder.add(i) for i in ids] + [decoder.flush()]


def supported(name: str) -> Tokenizer:
    """The vocabulary's tokenizer; the test skips where llmrun has no such tokenizer model."""
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp's {path.name} is not in {VOCAB_DIR}: {FETCH}")
    model = tokenizer_model(name)
    if model in UNSUPPORTED_MODELS:
        pytest.skip(
            f"{Keys.Tokenizer.MODEL} {model!r}: {UNSUPPORTED_MODELS[model]} is not supported"
        )
    return vocab(name)


@pytest.mark.parametrize(
    "name", REFERENCE_VOCABS or [pytest.param("", marks=pytest.mark.skip(reason=FETCH))]
)
def test_every_reference_string_matches_llama_cpp(name):
    tok = supported(name)
    cases = reference_cases(name)
    wrong = [
        (text, ids, got)
        for text, ids in cases
        if (got := tok.encode(text, add_bos=False, parse_special=False)) != ids
    ]
    assert not wrong, f"{len(cases) - len(wrong)}/{len(cases)} match"
    # WordPiece ("bert") lower-cases, strips accents and drops spaces: no way back to the text.
    if tokenizer_model(name) != "bert":
        assert [tok.decode(ids) for _, ids in cases] == [text for text, _ in cases]
    for _, ids in cases:
        assert "".join(streamed(tok, ids)) == tok.decode(ids)


# End of generation as llama.cpp sees it: the file's EOS, its end-of-turn tokens by text, its
# fill-in-the-middle pad/repo/file-separator tokens (Command-R's <PAD> is taken for one), and
# "</s>" where it is a plain token of the vocabulary (128247 in Qwen2's), except in Gemma 4.
@pytest.mark.parametrize(
    ("name", "add_bos", "bos", "eos", "eog"),
    [
        ("llama-spm", True, 1, 2, {2}),
        ("phi-3", True, 1, 32000, {2, 32000, 32007}),
        ("llama-bpe", True, 128000, 128001, {128001, 128009}),
        ("qwen2", False, 151643, 151643, {128247, 151643, 151645}),
        ("gpt-2", False, 50256, 50256, {50256}),
        ("command-r", True, 5, 255001, {0, 255001}),
        ("deepseek-llm", True, 100000, 100001, {100001}),
        ("falcon", False, 11, 11, {11}),
        ("starcoder", False, 0, 0, {0, 4}),
        ("gemma-4", True, 2, 1, {1, 50, 106}),
    ],
)
def test_special_ids_and_bos_defaults_follow_llama_cpp(name, add_bos, bos, eos, eog):
    tok = vocab(name)
    assert (tok.add_bos, tok.bos_id, tok.eos_id, tok.eog_ids) == (add_bos, bos, eos, eog)
    assert tok.add_eos is False
    assert (tok.encode("Hello")[:1] == [bos]) is add_bos
    assert tok.encode("Hello", add_bos=True)[0] == bos
    assert bos not in tok.encode("Hello", add_bos=False)


def test_bos_is_never_doubled():
    llama3 = vocab("llama-bpe")
    assert llama3.encode("<|begin_of_text|>Hello") == [128000, 9906]
    plain = llama3.encode("<|begin_of_text|>Hello", parse_special=False)
    assert plain[0] == 128000 and plain.count(128000) == 1
    assert vocab("llama-spm").encode("<s>Hello") == [1, 15043]


def test_control_tokens_parse_only_when_asked():
    qwen = vocab("qwen2")
    text = "<|im_start|>user\nhi<|im_end|>"
    assert qwen.encode(text) == [151644, 872, 198, 6023, 151645]
    plain = qwen.encode(text, parse_special=False)
    assert not {151644, 151645} & set(plain)
    assert qwen.decode(plain) == text
    assert qwen.token_id("<|im_end|>") == 151645
    assert qwen.token_id("no such token") is None
    assert qwen.decode([151644, 872, 151645]) == "user"
    assert qwen.decode([151644, 872, 151645], skip_special=False) == "<|im_start|>user<|im_end|>"


def test_user_defined_tokens_always_match_and_are_not_skipped():
    qwen = vocab("qwen2")
    assert qwen.encode("[PAD151646]", parse_special=False) == [151646]
    assert qwen.decode([151646]) == "[PAD151646]"


def test_sentencepiece_prefixes_a_space_after_special_tokens():
    spm = vocab("llama-spm")
    assert spm.encode("<s>Hello", add_bos=False) == [1, 15043]  # "▁Hello"
    assert spm.encode("<s>Hello", add_bos=False, parse_special=False) == [529, 29879, 29958, 10994]


def test_sentencepiece_space_runs_grow_from_the_left():
    # Runs of spaces share one score; llama.cpp merges equal scores leftmost first, so a run
    # becomes the longest space token (16) from the left, then the rest.
    ids = vocab("llama-spm").encode("a" + " " * 40 + "b", add_bos=False)
    assert ids == [263, 462, 462, 4706, 289]  # ▁a, 16, 16, 7 spaces, ▁b


def test_phi3_special_tokens_swallow_the_whitespace_after_them():
    # llama.cpp (recognising Phi-3 by general.name) and Phi-3's tokenizer.json both rstrip.
    prompt = "<|user|>\nHello<|end|>\n<|assistant|>\n"
    assert vocab("phi-3").encode(prompt, add_bos=False) == [32010, 15043, 32007, 32001]


# The ids in the tests below are llama.cpp's (llama-cpp-python 0.3.36), recorded by
# benchmarks/tokenizer_fuzz.py, which found the difference.


def test_phi3_special_tokens_swallow_only_ascii_whitespace():
    # llama.cpp strips what C's isspace() calls space (" \t\n\v\f\r"); the tokenizers
    # library would strip Unicode's (no-break, ideographic, line separator...) too.
    phi3 = vocab("phi-3")
    assert phi3.encode("<|end|>\xa0hi", add_bos=False) == [32007, 20246, 2918]
    assert phi3.encode("<|user|>\u3000Hello", add_bos=False) == [32010, 29871, 30358, 10994]
    assert phi3.encode("<|end|>\n\x85x", add_bos=False) == [32007, 29871, 197, 136, 29916]
    assert phi3.encode("<|end|>\u2028\n", add_bos=False) == [32007, 29871, 31353, 13]
    assert phi3.encode("<|assistant|> \xa0 ok", add_bos=False) == [32001, 20246, 3431]
    assert phi3.encode("<|end|>\v\f\t x", add_bos=False) == [32007, 921]
    assert phi3.encode("a</s>\xa0x</s> y", add_bos=False) == [263, 2, 20246, 29916, 2, 343]
    plain = [263, 829, 29879, 29958, 30081, 29916, 829, 29879, 29958, 343]
    assert phi3.encode("a</s>\xa0x</s> y", add_bos=False, parse_special=False) == plain


def test_a_mask_token_swallows_only_ascii_whitespace_before_it():
    # llama.cpp lstrips "<mask>" for Jina v2 (by tokenizer.ggml.pre); ids from llama.cpp on
    # a vocabulary-only GGUF file of this metadata.
    metadata = gguf_metadata(
        **{
            Keys.Tokenizer.PRE: "jina-v2-de",
            Keys.Tokenizer.LIST: ["a", "b", "Ġ", "Â", "ł", "Âł", "ĉ", "Ċ", "<mask>", "<|x|>"],
            Keys.Tokenizer.TOKEN_TYPE: [1] * 8 + [3, 3],
            Keys.Tokenizer.MERGES: ["Â ł"],
            Keys.Tokenizer.BOS_ID: 9,
            Keys.Tokenizer.ADD_BOS: None,
        }
    )
    tok = Tokenizer.from_gguf_metadata(metadata, "jina.gguf")
    assert tok.encode("a <mask>b") == [0, 8, 1]
    assert tok.encode("a\t \n<mask>b") == [0, 8, 1]
    assert tok.encode("a\xa0<mask>") == [0, 5, 8]
    assert tok.encode("a \xa0 <mask>") == [0, 2, 5, 8]
    assert tok.encode("<mask> a") == [8, 2, 0]


def test_overlapping_special_tokens_are_matched_longest_first():
    # Falcon's ">>TITLE<<" ends with the "<" that "<|endoftext|>" starts with. llama.cpp
    # takes the longest special token first, wherever it is; the tokenizers library would
    # take the leftmost (">>TITLE<<", then "|endoftext|>" as text).
    falcon = vocab("falcon")
    assert falcon.encode(">>TITLE<<|endoftext|>") == [500, 6539, 39, 11]
    text = "x>>SUMMARY<<|endoftext|>>>ANSWER<< y"
    assert falcon.encode(text) == [99, 500, 54974, 39, 11, 5, 291]
    assert falcon.encode("<|endoftext|>>>TITLE<<") == [11, 0]
    plain = [99, 500, 54974, 503, 103, 415, 1487, 2164, 103, 19613, 20842, 503, 291]
    assert falcon.encode(text, parse_special=False) == plain
    assert falcon.encode_batch([text, text], parse_special=False) == [plain, plain]
    assert falcon.encode_batch([text]) == [[99, 500, 54974, 39, 11, 5, 291]]


def test_characters_new_in_unicode_16_are_in_no_category():
    # llama.cpp's character tables are Unicode 15.1's: Todhri (U+105C0...), Garay (U+10D40...)
    # and the rest of Unicode 16.0 are unassigned there, no letters, digits or symbols.
    coder = vocab("deepseek-coder")
    assert coder.encode("  \U000105d1", add_bos=False) == [243, 170, 225, 232, 226]
    assert coder.encode("  \U000140f2", add_bos=False) == [243, 170, 229, 212, 110]
    ids = [87, 109697, 238, 113, 222, 172, 238, 113, 223]
    assert vocab("llama-bpe").encode("x \U00010d40\U00010d41", add_bos=False) == ids
    assert vocab("qwen35").encode("\U00016117(x", add_bos=False) == [125427, 226, 245, 7, 87]


def test_a_byte_without_a_token_is_dropped_and_nothing_merges_across_it():
    # Falcon's vocabulary has no token for some bytes (\v, \x03...). llama.cpp keeps such a
    # character in its word, where no merge takes it, and then drops it: "\n" and " " stay
    # apart, where the tokenizers library would drop it first and merge them into "\n ".
    falcon = vocab("falcon")
    assert falcon.encode("\n\v ", add_bos=False) == [193, 204]
    assert falcon.encode(" \v ", add_bos=False) == [204, 204]
    assert falcon.encode("\xa0\v\xa0", add_bos=False) == [4381, 4381]
    assert falcon.encode("Hello\v world", add_bos=False) == [9856, 1079]
    # StarCoder's and Refact's have none for 0xF1 (U+40000 to U+7FFFF start with it).
    ids = [190, 129, 121, 242, 124, 227, 246]
    assert vocab("refact").encode("\U000b2a4f\U0006c013", add_bos=False) == ids
    ids = [206, 274, 252, 278, 264, 153]
    assert vocab("starcoder").encode("\ue706\U000604b7", add_bos=False) == ids


def test_token_to_piece_prints_what_llama_tokenize_prints():
    assert vocab("qwen2").token_to_piece(1879) == " world"
    assert vocab("qwen2").token_to_piece(151645) == "<|im_end|>"
    assert vocab("llama-spm").token_to_piece(15043) == " Hello"
    assert vocab("llama-spm").token_to_piece(13) == "\n"
    assert vocab("llama-spm").token_bytes(243) == b"\xf0"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        vocab("gpt-2").token_to_piece(50257)


@needs_stories
def test_gguf_tokenizer_matches_tokenizer_json():
    gguf_tok = stories_gguf()
    hf_tok = load_tokenizer(STORIES_HF)
    reference = Backend.from_file(str(STORIES_HF / "tokenizer.json"))
    assert gguf_tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert hf_tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    for text in TEXTS:
        ids = reference.encode(text).ids
        assert gguf_tok.encode(text) == ids
        assert hf_tok.encode(text) == ids
        assert gguf_tok.decode(ids) == hf_tok.decode(ids) == reference.decode(ids) == text
    for attr in ("bos_id", "eos_id", "add_bos", "vocab_size", "special_ids"):
        assert getattr(gguf_tok, attr) == getattr(hf_tok, attr)


@needs_stories
def test_gguf_space_prefix_follows_llama_cpp():
    # llama.cpp prefixes a space even to text that starts with one (" Hello" is [29871, 15043]
    # in the Llama reference); this tokenizer.json's Metaspace does not.
    assert stories_gguf().encode(" Once") == [1, 410, 403]
    assert load_tokenizer(STORIES_HF).encode(" Once") == [1, 403]
    assert stories_gguf().decode([1, 410, 403]) == " Once"


@needs_stories
def test_byte_fallback_decode_matches_tokenizer_json_on_valid_text():
    tok = stories_gguf()
    reference = Backend.from_file(str(STORIES_HF / "tokenizer.json"))
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(12))]
        expected = reference.decode(ids)
        # tokenizers turns every byte of an invalid byte run into U+FFFD, even ASCII ones.
        if "\ufffd" not in expected:
            assert tok.decode(ids) == expected


@needs_stories
def test_hf_dir_reads_bos_eos_from_tokenizer_config(tmp_path):
    shutil.copy(STORIES_HF / "tokenizer.json", tmp_path)
    config = tmp_path / "tokenizer_config.json"

    tok = load_tokenizer(tmp_path)  # no config: BOS from the post-processor template
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, None, True)

    config.write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.eog_ids) == (1, 2, True, {2})

    config.write_text(json.dumps({"bos_token": "<s>", "add_bos_token": False}))
    assert load_tokenizer(tmp_path).encode("Once") == [403]


def test_missing_or_broken_tokenizer_files_raise(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "missing.gguf")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_gpt2_vocab_agrees_with_an_independent_tokenizer_json(tmp_path):
    # Built by tokenizers itself: its own GPT-2 split regex and ByteLevel decoder.
    from llmrun.loading.gguf_io import read_gguf

    vocab("gpt-2")  # skips where it is absent
    meta = read_gguf(VOCAB_DIR / "ggml-vocab-gpt-2.gguf", with_tensors=False).metadata
    tokens = meta[Keys.Tokenizer.LIST]
    merges = [tuple(m.split(" ")) for m in meta[Keys.Tokenizer.MERGES]]
    reference = Backend(BPE({t: i for i, t in enumerate(tokens)}, merges))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    reference.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    reference.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))

    gguf_tok, hf_tok = vocab("gpt-2"), load_tokenizer(tmp_path)
    for text, ids in reference_cases("gpt-2"):
        assert reference.encode(text).ids == ids
        assert hf_tok.encode(text, parse_special=False) == ids
        assert hf_tok.decode(ids) == text
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokens)) for _ in range(rng.randrange(8))]
        expected = reference.decode(ids, skip_special_tokens=False)
        assert gguf_tok.decode(ids, skip_special=False) == expected
        assert hf_tok.decode(ids, skip_special=False) == expected
        assert "".join(streamed(hf_tok, ids, skip_special=False)) == expected


@pytest.mark.parametrize("source", ["stories", *REFERENCE_VOCABS])
@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_concatenates_to_decode_and_never_splits_a_character(source, skip_special):
    tok = stories_gguf() if source == "stories" else supported(source)
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 16))]
        full = tok.decode(ids, skip_special=skip_special)
        shown = ""
        for piece in streamed(tok, ids, skip_special=skip_special):
            shown += piece
            # Every U+FFFD shown so far is one that the full decode has there too.
            assert full.startswith(shown)
        assert shown == full


@needs_stories
def test_stream_holds_back_a_character_split_over_byte_tokens():
    tok = stories_gguf()
    ids = tok.encode("😀!")
    assert ids[:6] == [1, 410, 243, 162, 155, 131]  # "▁", then four byte tokens
    assert streamed(tok, ids) == ["", "", "", "", "", "😀", "!", ""]
    assert streamed(tok, [0xE2 + 3]) == ["", "\ufffd"]  # a lone lead byte, flushed


def test_stream_of_byte_level_text_shows_no_replacement_characters():
    qwen = vocab("qwen2")
    text = next(t for t, _ in reference_cases("qwen2") if t.startswith("\u1780"))  # Khmer
    pieces = streamed(qwen, qwen.encode(text))
    assert "".join(pieces) == text
    assert "" in pieces[:-1] and not any("\ufffd" in p for p in pieces)


@needs_stories
def test_stream_after_a_prompt_keeps_the_leading_space():
    tok = stories_gguf()
    assert streamed(tok, [407]) == ["upon", ""]
    assert streamed(tok, [407], after=[1, 403]) == [" upon", ""]
    assert streamed(tok, [407], after=[1]) == ["upon", ""]


def gguf_metadata(**changes) -> dict:
    meta = {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.PRE: "gpt-2",
        Keys.Tokenizer.LIST: ["a", "b", "ab", "<|endoftext|>"],
        Keys.Tokenizer.TOKEN_TYPE: [1, 1, 1, 3],
        Keys.Tokenizer.MERGES: ["a b"],
        Keys.Tokenizer.BOS_ID: 3,
        Keys.Tokenizer.ADD_BOS: True,
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def test_small_gguf_vocabulary_builds():
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(), "tiny.gguf")
    assert tok.encode("abba") == [3, 2, 1, 0]
    assert tok.decode([3, 2, 1, 0]) == "abba"
    assert tok.special_ids == {3}


def test_out_of_range_token_ids_mean_none():
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(**{Keys.Tokenizer.BOS_ID: 0xFFFFFFFF}), "t")
    assert tok.bos_id is None and tok.add_bos is True
    assert tok.encode("ab") == [2]
    assert tok.decode([2, 99, -1]) == "ab"


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({Keys.Tokenizer.PRE: "mystery"}, UnsupportedError, "'mystery' is not supported"),
        ({Keys.Tokenizer.MODEL: "test"}, UnsupportedError, "tokenizer.ggml.model 'test'"),
        ({Keys.Tokenizer.MODEL: None}, TokenizerError, "no tokenizer.ggml.model"),
        ({Keys.Tokenizer.LIST: None}, TokenizerError, "no tokenizer.ggml.tokens"),
        ({Keys.Tokenizer.MERGES: None}, TokenizerError, "no tokenizer.ggml.merges"),
        ({Keys.Tokenizer.MERGES: ["a c"]}, TokenizerError, "tokenizer.ggml.merges does not fit"),
        ({Keys.Tokenizer.TOKEN_TYPE: [1]}, TokenizerError, "tokenizer.ggml.token_type has 1"),
    ],
)
def test_bad_gguf_metadata_names_the_key(changes, error, match):
    with pytest.raises(error, match=match) as info:
        Tokenizer.from_gguf_metadata(gguf_metadata(**changes), "bad.gguf")
    assert str(info.value).startswith("bad.gguf: ")


def test_importing_the_tokenizer_does_not_import_torch():
    code = "import sys, llmrun.tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


BATCH_VOCABS = ["llama-spm", "llama-bpe", "qwen2", "gemma-4", "deepseek-llm"]


@pytest.mark.parametrize("name", BATCH_VOCABS)
@pytest.mark.parametrize("threads", [None, 1, 2])
def test_encode_batch_is_encode_of_each_text(name, threads):
    tok = supported(name)
    texts = [text for text, _ in reference_cases(name)] + ["<|im_end|><s> x", ""]
    for options in ({}, {"add_bos": False, "parse_special": False}, {"add_bos": True}):
        expected = [tok.encode(text, **options) for text in texts]
        assert tok.encode_batch(texts, threads=threads, **options) == expected


@needs_stories
def test_encode_batch_of_a_tokenizer_json_is_encode_of_each_text():
    # Its post-processor would add BOS again: encode_batch, like encode, leaves it out.
    tok = load_tokenizer(STORIES_HF)
    for options in ({}, {"add_bos": False}):
        assert tok.encode_batch(TEXTS, **options) == [tok.encode(t, **options) for t in TEXTS]


def test_encode_batch_refuses_no_threads():
    with pytest.raises(TokenizerError, match="threads must be at least 1"):
        stories_gguf().encode_batch(["x"], threads=0)


def test_cli_batch_prints_one_list_per_line_in_order():
    tok = supported("qwen2")
    texts = [text for text, _ in reference_cases("qwen2") if "\n" not in text and "\r" not in text]
    texts += ["<|im_start|>user", ""]
    path = str(VOCAB_DIR / "ggml-vocab-qwen2.gguf")
    result = llmrun("tokenize", path, "--batch", "--threads", "2", input="\n".join(texts) + "\n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines.pop() == ""
    assert [json.loads(line) for line in lines] == [tok.encode(t) for t in texts]

    result = llmrun(
        "tokenize", path, "--batch", "--pieces", "--no-special", input="Hi there\n<|im_end|>"
    )
    assert [json.loads(line) for line in result.stdout.splitlines()] == [
        [{"id": 13048, "piece": "Hi"}, {"id": 1052, "piece": " there"}],
        [{"id": i, "piece": tok.token_to_piece(i)} for i in tok.encode("<|im_end|>", False, False)],
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "Hello"], "--batch reads its texts from stdin"),
        (["Hello", "--threads", "2"], "--threads goes with --batch"),
    ],
)
def test_cli_batch_usage_errors(args, message):
    result = llmrun("tokenize", str(STORIES_GGUF), *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_cli_tokenize_of_a_vocab_only_gguf_imports_no_torch():
    path = VOCAB_DIR / "ggml-vocab-gemma-4.gguf"  # 262,144 tokens
    supported("gemma-4")
    code = (
        f"import sys; sys.argv = ['llmrun', 'tokenize', {str(path)!r}, 'Hi there']\n"
        "from llmrun.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == vocab("gemma-4").encode("Hi there")


def llama_cpp_spm(vocab: dict[str, int], scores: list[float], text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm_session) on one run of text whose
    spaces are already U+2581: merge the adjacent pair whose joined text is the best-scoring
    token, the leftmost on a tie, until none is; spell what is left with byte tokens.
    `vocab`: each token's id."""
    symbols = [[c, i - 1, i + 1] for i, c in enumerate(text)]  # text, prev, next
    if symbols:
        symbols[-1][2] = -1
    queue: list = []
    parts = {}

    def pair(left: int, right: int) -> None:
        if left != -1 and right != -1:
            joined = symbols[left][0] + symbols[right][0]
            if joined in vocab:
                heapq.heappush(queue, (-scores[vocab[joined]], left, len(joined), right))
                parts[joined] = (symbols[left][0], symbols[right][0])

    for i in range(1, len(symbols)):
        pair(i - 1, i)
    while queue:
        _, left, size, right = heapq.heappop(queue)
        a, b = symbols[left], symbols[right]
        if a[0] and b[0] and len(a[0]) + len(b[0]) == size:
            a[0], b[0], a[2] = a[0] + b[0], "", b[2]
            if b[2] != -1:
                symbols[b[2]][1] = left
            pair(a[1], left)
            pair(left, a[2])
    ids: list[int] = []

    def spell(piece: str) -> None:
        if piece in vocab:
            ids.append(vocab[piece])
        elif piece in parts:
            spell(parts[piece][0])
            spell(parts[piece][1])
        else:
            ids.extend(vocab[f"<0x{byte:02X}>"] for byte in piece.encode())

    for piece, _, _ in symbols:
        if piece:
            spell(piece)
    return ids


def random_texts(count: int, seed: int) -> list[str]:
    pool = list("aAbeinorst  .,'\n\t") + [
        "the",
        "ing",
        "tion",
        " the",
        "\u65e5\u672c",
        "\U0001f600",
    ]
    pool += ["\u00e9", "\u00df", "  ", "    ", "<unused1>", "<0x41>"]
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 30))) for _ in range(count)]


@pytest.mark.parametrize("name", ["llama-spm", "gemma-262k-spm"])
def test_sentencepiece_merges_as_llama_cpp_does(name):
    from llmrun.loading.gguf_io import read_gguf

    source = "gemma-4" if name == "gemma-262k-spm" else name
    supported(source)
    meta = read_gguf(VOCAB_DIR / f"ggml-vocab-{source}.gguf", with_tensors=False).metadata
    if name == "gemma-262k-spm":
        # Gemma 4's 262,144 tokens as a SentencePiece vocabulary, as large as Gemma 3's.
        meta = {k: v for k, v in meta.items() if k != Keys.Tokenizer.MERGES}
        meta[Keys.Tokenizer.MODEL] = "llama"
        meta[Keys.Tokenizer.SCORES] = [-float(i) for i in range(len(meta[Keys.Tokenizer.LIST]))]
    tok = Tokenizer.from_gguf_metadata(meta, name)
    scores = meta[Keys.Tokenizer.SCORES]
    vocab = {t: i for i, t in enumerate(meta[Keys.Tokenizer.LIST])}
    prefix = "\u2581" if meta.get(Keys.Tokenizer.ADD_PREFIX, True) else ""
    texts = [text for text, _ in reference_cases(source)] + random_texts(200, 0)
    for text in texts:
        # llama.cpp has no run of text at all for an empty one, so no space prefix either.
        run = prefix + text if text else ""
        expected = llama_cpp_spm(vocab, scores, run.replace(" ", "\u2581"))
        assert tok.encode(text, add_bos=False, parse_special=False) == expected, repr(text)
