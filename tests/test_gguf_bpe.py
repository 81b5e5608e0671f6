"""The C merging of GGUF vocabularies (llmrun.gguf_bpe) against the tokenizers library's BPE,
an independent implementation, and llama.cpp's reference ids through both: every test set
string, random text, and the corners where the two merge differently by design."""

import random

import pytest
from gguf import Keys
from helpers import VOCAB_DIR
from test_tokenizer import FETCH, reference_cases
from tokenizers import Tokenizer as Backend

from llmrun import native
from llmrun.errors import TokenizerError
from llmrun.gguf_bpe import MergingBackend
from llmrun.loading.gguf_io import read_gguf
from llmrun.token_bytes import BYTE_LEVEL_ALPHABET, byte_level_bytes
from llmrun.tokenizer import Tokenizer

MERGED = ("llama", "gpt2", "gemma4", "whitespace")  # the tokenizer models merged in C
VOCABS = sorted(
    p.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
    for p in VOCAB_DIR.glob("ggml-vocab-*.gguf")
    if read_gguf(p, with_tensors=False).metadata.get(Keys.Tokenizer.MODEL) in MERGED
)
BYTE_CHAR = {byte_level_bytes(c)[0]: c for c in BYTE_LEVEL_ALPHABET}  # GPT-2's, by byte
needs_c = pytest.mark.skipif(native.tokenize_library() is None, reason="no C compiler here")


def metadata(name: str) -> dict:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp's {path.name} is not in {VOCAB_DIR}: {FETCH}")
    meta = read_gguf(path, with_tensors=False).metadata
    if meta[Keys.Tokenizer.MODEL] not in MERGED:
        pytest.skip(f"{name}: tokenizer model {meta[Keys.Tokenizer.MODEL]!r} is not merged in C")
    return meta


def both(meta: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[Tokenizer, Tokenizer]:
    """The vocabulary merged in C, and by the library (as where nothing can be compiled)."""
    merged = Tokenizer.from_gguf_metadata(meta, "vocab.gguf")
    with monkeypatch.context() as patch:
        patch.setattr(native, "tokenize_library", lambda: None)
        library = Tokenizer.from_gguf_metadata(meta, "vocab.gguf")
    assert isinstance(library._backend, Backend)
    return merged, library


def random_text(rng: random.Random) -> str:
    """Words, numbers, code, CJK, emoji, combining marks, whitespace runs and newlines."""
    pieces = [
        "Hello",
        " world",
        "don't",
        "  ",
        "\n",
        "\n\n\n",
        "\t",
        " \n ",
        "1234567",
        "3.14",
        "def f(x):\n    return x",
        "日本語",
        "中文字",
        "😀",
        "👨\u200d👩\u200d👧",
        "e\u0301",
        "ß",
        "Ωμέγα",
        "привет",
        "<",
        ">",
        "!!",
        "\r\n",
        "\u00a0",
    ]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
    chars = [chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 4))]
    return text + "".join(chars)


@needs_c
@pytest.mark.parametrize("name", VOCABS or [pytest.param("", marks=pytest.mark.skip(reason=FETCH))])
def test_merged_in_c_and_by_the_library_alike_on_the_test_set_and_random_text(name, monkeypatch):
    merged, library = both(metadata(name), monkeypatch)
    assert isinstance(merged._backend, MergingBackend)
    rng = random.Random(name)
    texts = [random_text(rng) for _ in range(300)]
    if VOCAB_DIR.joinpath(f"ggml-vocab-{name}.gguf.inp").is_file():
        cases = reference_cases(name)
        texts += [text for text, _ in cases]
        for text, ids in cases:  # llama.cpp's own ids, through both
            assert merged.encode(text, add_bos=False, parse_special=False) == ids, text
            assert library.encode(text, add_bos=False, parse_special=False) == ids, text
    for text in texts:
        for parse_special in (True, False):
            got = merged.encode(text, parse_special=parse_special)
            assert got == library.encode(text, parse_special=parse_special), text


def sentencepiece(tokens: list[str], scores: list[float], types: list[int], add_prefix: bool):
    """sentencepiece's own BPE encoder for the vocabulary (its normal, byte and unknown
    pieces), whose merging llama.cpp's SentencePiece tokenizer follows."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = 6 in types
    spec = model.normalizer_spec
    spec.name, spec.add_dummy_prefix, spec.escape_whitespaces = "identity", add_prefix, True
    spec.remove_extra_whitespaces = False
    kinds = {2: pb.ModelProto.SentencePiece.UNKNOWN, 6: pb.ModelProto.SentencePiece.BYTE}
    for token, score, kind in zip(tokens, scores, types, strict=True):
        piece = model.pieces.add()
        piece.piece, piece.score = token, score
        piece.type = kinds.get(kind, pb.ModelProto.SentencePiece.NORMAL)
    return SentencePieceProcessor(model_proto=model.SerializeToString())


@needs_c
def test_a_262k_sentencepiece_vocabulary_with_tied_scores_merges_as_sentencepiece():
    """Ties (equal scores) go to the leftmost pair, as in sentencepiece and llama.cpp; the
    library's BPE ranks pairs once for all, and parts from both on some texts."""
    pytest.importorskip("sentencepiece")
    meta = metadata("gemma-4")
    rng = random.Random(0)
    tokens = meta[Keys.Tokenizer.LIST]
    types = [6 if kind == 6 else 1 for kind in meta[Keys.Tokenizer.TOKEN_TYPE]]
    types[meta[Keys.Tokenizer.UNK_ID]] = 2
    scores = [float(rng.randint(-50, 0)) for _ in tokens]
    spm = sentencepiece(tokens, scores, types, add_prefix=True)
    meta = {k: v for k, v in meta.items() if k != Keys.Tokenizer.MERGES}
    meta |= {Keys.Tokenizer.MODEL: "llama", Keys.Tokenizer.SCORES: scores}
    meta |= {Keys.Tokenizer.TOKEN_TYPE: types, Keys.Tokenizer.ADD_PREFIX: True}
    merged = Tokenizer.from_gguf_metadata(meta, "spm-262k.gguf")
    assert isinstance(merged._backend, MergingBackend)
    for text in [random_text(rng) for _ in range(200)]:
        assert merged.encode(text, add_bos=False, parse_special=False) == spm.encode(text), text


def random_bpe(rng: random.Random, n_merges: int) -> dict:
    """A byte-level vocabulary grown by random merges of its own tokens, as training would."""
    tokens = [*BYTE_LEVEL_ALPHABET, "ab"]
    letters = [BYTE_CHAR[b] for b in b"abcd \n"]
    pool, merges, seen = [*letters, "ab"], ["a b"], set(tokens)
    while len(merges) < n_merges:
        left, right = rng.choice(pool), rng.choice(pool)
        if left + right in seen or len(left + right) > 6:
            continue
        seen.add(left + right)
        tokens.append(left + right)
        pool.append(left + right)
        merges.append(f"{left} {right}")
    return {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.PRE: "gpt-2",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.TOKEN_TYPE: [1] * len(tokens),
        Keys.Tokenizer.MERGES: merges,
    }


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_random_merges_apply_as_the_library_applies_them(seed, monkeypatch):
    rng = random.Random(seed)
    merged, library = both(random_bpe(rng, 300), monkeypatch)
    for _ in range(300):
        text = "".join(rng.choice("abcd \n") for _ in range(rng.randint(1, 40)))
        assert merged.encode(text) == library.encode(text), text


@needs_c
def test_a_byte_alphabet_character_without_a_token_stops_merges_across_it(monkeypatch):
    """llama.cpp keeps such a character in its word, where no merge takes it, and drops it at
    the end; the library's BPE needs the word cut there (llmrun.pretokenizers), and the two
    give llama.cpp's ids."""
    meta = random_bpe(random.Random(7), 200)
    absent = {BYTE_CHAR[b] for b in b"!~"}
    meta[Keys.Tokenizer.LIST] = [t for t in meta[Keys.Tokenizer.LIST] if t not in absent]
    meta[Keys.Tokenizer.TOKEN_TYPE] = [1] * len(meta[Keys.Tokenizer.LIST])
    merged, library = both(meta, monkeypatch)
    ab = merged.token_id("ab")
    assert ab is not None and merged.encode("a!b") == merged.encode("a") + merged.encode("b")
    for text in ["a!b", "ab~ab", "!!", "a~", "abcd!dcba ab!"]:
        assert merged.encode(text) == library.encode(text), text


def random_spm(rng: random.Random, byte_tokens: bool, unk: bool, ties: bool) -> dict:
    chars = list("abcd ▁") + ["é", "日"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256) if byte_tokens]
    tokens += chars
    while len(tokens) < 400:
        token = "".join(rng.choice(chars) for _ in range(rng.randint(2, 5)))
        if token not in tokens:
            tokens.append(token)
    types = [2, 3, 3] + [6] * (256 if byte_tokens else 0)
    types += [1] * (len(tokens) - len(types))
    scores = [float(rng.randint(-9, 0)) if ties else -rng.random() for _ in tokens]
    return {
        Keys.Tokenizer.MODEL: "llama",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.TOKEN_TYPE: types,
        Keys.Tokenizer.SCORES: scores,
        Keys.Tokenizer.UNK_ID: 0 if unk else 0xFFFFFFFF,
    }


@needs_c
@pytest.mark.parametrize("add_prefix", [True, False])
def test_sentencepiece_merges_by_score_as_sentencepiece(add_prefix):
    pytest.importorskip("sentencepiece")
    rng = random.Random(f"{add_prefix}")
    meta = random_spm(rng, byte_tokens=True, unk=True, ties=True)
    meta |= {Keys.Tokenizer.ADD_PREFIX: add_prefix}
    merged = Tokenizer.from_gguf_metadata(meta, "spm.gguf")
    tokens, scores = meta[Keys.Tokenizer.LIST], meta[Keys.Tokenizer.SCORES]
    spm = sentencepiece(tokens, scores, meta[Keys.Tokenizer.TOKEN_TYPE], add_prefix)
    for _ in range(300):
        text = "".join(rng.choice("abcd é日ñ\n") for _ in range(rng.randint(1, 30)))
        assert merged.encode(text, add_bos=False) == spm.encode(text), text
    # A character without a token: its bytes' tokens.
    assert merged.encode("ñ", add_bos=False)[-2:] == [0xC3 + 3, 0xB1 + 3]


@needs_c
def test_without_byte_tokens_a_character_is_unk_as_by_the_library(monkeypatch):
    """Where sentencepiece fuses a run of unknown characters into one <unk> (and llama.cpp
    stops: it finds no byte token), llmrun gives each its <unk>, as the library does."""
    rng = random.Random(3)
    merged, library = both(random_spm(rng, byte_tokens=False, unk=True, ties=False), monkeypatch)
    for _ in range(300):
        text = "".join(rng.choice("abcd é日ñ\n") for _ in range(rng.randint(0, 30)))
        assert merged.encode(text) == library.encode(text), text
    assert merged.encode("ññ", add_bos=False)[-2:] == [0, 0]


@needs_c
def test_without_byte_tokens_or_unk_a_character_is_left_out_where_it_stands():
    """No reference has this case (llama.cpp stops); the character is dropped, and as
    llama.cpp keeps such a character in place in BPE, no merge reaches across it (the
    library's BPE drops it first, and merges across)."""
    meta = {
        Keys.Tokenizer.MODEL: "llama",
        Keys.Tokenizer.LIST: ["<s>", "</s>", "d", "dd"],
        Keys.Tokenizer.TOKEN_TYPE: [3, 3, 1, 1],
        Keys.Tokenizer.SCORES: [0.0, 0.0, -2.0, -1.0],
        Keys.Tokenizer.UNK_ID: 0xFFFFFFFF,
        Keys.Tokenizer.ADD_PREFIX: False,
    }
    merged = Tokenizer.from_gguf_metadata(meta, "spm.gguf")
    assert merged.encode("dd", add_bos=False) == [3]
    assert merged.encode("dñd", add_bos=False) == [2, 2]
    assert merged.encode("ññ", add_bos=False) == []


@needs_c
def test_text_that_is_not_utf8_encodes_as_by_the_library(monkeypatch):
    merged, library = both(metadata("qwen2"), monkeypatch)
    text = "a\udc80b \ud800"
    assert merged.encode(text) == library.encode(text) != []


@needs_c
@pytest.mark.parametrize("merges", [["a c"], ["a b", "ab zz"]])
def test_a_merge_outside_the_vocabulary_is_an_error_either_way(merges, monkeypatch):
    meta = random_bpe(random.Random(1), 5) | {Keys.Tokenizer.MERGES: merges}
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges does not fit"):
        Tokenizer.from_gguf_metadata(meta, "bad.gguf")
    monkeypatch.setattr(native, "tokenize_library", lambda: None)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges does not fit"):
        Tokenizer.from_gguf_metadata(meta, "bad.gguf")
