"""Building from GGUF metadata fast changes nothing: the vectorised SentencePiece merges are
exactly the plain loop's (on real and on adversarial vocabularies, through every fallback), and
the build leaves the garbage collector as it found it."""

import functools
import gc
import random

import pytest
from gguf import Keys
from helpers import VOCAB_DIR

from llmrun import spm_merges as merges_module
from llmrun.errors import TokenizerError
from llmrun.spm_merges import spm_merges, spm_merges_reference
from llmrun.tokenizer import Tokenizer
from llmrun.tokenizer_gguf import _gguf_vocab

FETCH = "run python tests/data/fetch.py"


@functools.cache
def metadata(name: str) -> dict:
    from llmrun.loading.gguf_io import read_gguf

    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp's {path.name} is not in {VOCAB_DIR}: {FETCH}")
    return read_gguf(path, with_tensors=False).metadata


def real_vocabulary(name: str) -> tuple[dict[str, int], list[float]]:
    if name == "gemma-262k-spm":  # Gemma 4's 262,144 tokens, given SentencePiece scores
        tokens = metadata("gemma-4")[Keys.Tokenizer.LIST]
        return _gguf_vocab(tokens), [-float(i) for i in range(len(tokens))]
    meta = metadata(name)
    return _gguf_vocab(meta[Keys.Tokenizer.LIST]), meta[Keys.Tokenizer.SCORES]


@pytest.mark.parametrize("name", ["llama-spm", "gemma-262k-spm"])
def test_merges_of_real_vocabularies_are_the_plain_loops(name):
    vocab, scores = real_vocabulary(name)
    fast = spm_merges(vocab, scores)
    assert len(fast) > len(vocab) // 2
    assert fast == spm_merges_reference(vocab, scores)


def test_equal_scores_are_ordered_as_the_plain_loop_orders_them():
    # Every score the same (a file without scores): the texts settle every tie.
    vocab, scores = real_vocabulary("llama-spm")
    zeros = [0.0] * len(scores)
    assert spm_merges(vocab, zeros) == spm_merges_reference(vocab, zeros)


def random_vocabulary(rng: random.Random) -> tuple[dict[str, int], list[float]]:
    # Few characters, so that many tokens split many ways; NUL, astral and combining
    # characters, runs of U+2581; few distinct scores (with -0.0 and 0.0), so that ties abound.
    alphabet = ["a", "b", "\x00", "\u2581", "\U0001f600", "\u0301", "\u65e5", "<", ">"]
    tokens = [rng.choice(alphabet) for _ in range(6)]
    tokens += ["".join(rng.choices(alphabet, k=rng.randrange(1, 9))) for _ in range(300)]
    tokens += ["", tokens[5], "\u2581" * 12]  # empty, a duplicate (the later id wins)
    rng.shuffle(tokens)
    values = [0.0, -0.0, -1.5, -2.0, 3.0, float(-(10**6))]
    scores = [rng.choice(values) for _ in tokens]
    return _gguf_vocab(tokens), scores


@pytest.mark.parametrize("seed", range(25))
def test_merges_of_random_vocabularies_are_the_plain_loops(seed):
    vocab, scores = random_vocabulary(random.Random(seed))
    assert spm_merges(vocab, scores) == spm_merges_reference(vocab, scores)


def test_a_hash_match_is_checked_against_the_text(monkeypatch):
    # With base 1 a hash is the sum of the characters: "aa" (inside "aaz") hashes as the token
    # "`b" does, and has its length, but is not it. The whole tokens' hashes all differ.
    monkeypatch.setattr(merges_module, "_BASE", 1)
    vocab = {"`b": 0, "z": 1, "aaz": 2, "x": 3, "`bx": 4}
    scores = [0.0, 0.0, -1.0, 0.0, -2.0]
    assert spm_merges(vocab, scores) == spm_merges_reference(vocab, scores) == [("`b", "x")]


def test_tokens_of_one_hash_take_the_plain_loop(monkeypatch):
    monkeypatch.setattr(merges_module, "_BASE", 1)  # "ab" and "ba" hash alike
    monkeypatch.setattr(merges_module, "spm_merges_reference", lambda v, s: "plain loop")
    assert spm_merges({"a": 0, "b": 1, "ab": 2, "ba": 3}, [0.0] * 4) == "plain loop"


@pytest.mark.parametrize(
    ("vocab", "scores"),
    [
        ({"a": 0, "b": 1, "ab": 2}, [0.0, float("nan"), -1.0]),  # no numeric order
        ({"a": 0, "\udcff": 1, "a\udcff": 2}, [0.0, 0.0, 0.0]),  # not UTF-8 (gguf_io's escape)
    ],
)
def test_what_numpy_cannot_order_or_hold_takes_the_plain_loop(vocab, scores, monkeypatch):
    expected = spm_merges_reference(vocab, scores)
    monkeypatch.setattr(merges_module, "spm_merges_reference", lambda v, s: ("plain", v, s))
    assert spm_merges(vocab, scores) == ("plain", vocab, scores)
    monkeypatch.undo()
    assert spm_merges(vocab, scores) == expected


def test_no_splits_at_all():
    assert spm_merges({"a": 0, "b": 1}, [0.0, 0.0]) == []
    assert spm_merges({}, []) == []


def tiny_metadata(**changes) -> dict:
    meta = {
        Keys.Tokenizer.MODEL: "llama",
        Keys.Tokenizer.LIST: ["<unk>", "<s>", "</s>", "\u2581", "a", "\u2581a"],
        Keys.Tokenizer.SCORES: [0.0, 0.0, 0.0, -1.0, -2.0, -0.5],
        Keys.Tokenizer.TOKEN_TYPE: [2, 3, 3, 1, 1, 1],
    }
    meta.update(changes)
    return meta


def test_the_build_leaves_the_garbage_collector_as_it_found_it():
    assert gc.isenabled()
    assert Tokenizer.from_gguf_metadata(tiny_metadata(), "tiny.gguf").encode("a") == [1, 5]
    assert gc.isenabled()
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf_metadata(tiny_metadata(**{Keys.Tokenizer.SCORES: [0.0]}), "t")
    assert gc.isenabled()
    gc.disable()
    try:
        Tokenizer.from_gguf_metadata(tiny_metadata(), "tiny.gguf")
        assert not gc.isenabled()
    finally:
        gc.enable()
