"""A folder's tekken.json (Mistral's tokenizer file) against mistral_common's Tekkenizer,
which reads it for Mistral: the ids of a multilingual text set with BOS and EOS either
way, the decode and streamed pieces of its ids, special tokens where they parse; a folder
with only tekken.json runs end to end; the vocabulary and merges are those llama.cpp's
converter writes to a GGUF (gguf-py's MistralVocab). The small file is the first ranks of
the Mistral Nemo vocabulary that mistral_common ships, with Mistral's special tokens of a
recent file; the whole Nemo file (no special_tokens: Mistral's first twenty) is checked too.
"""

import functools
import itertools
import json
from pathlib import Path

import pytest
import torch
from helpers import save_hf_dir, tiny_hf_model
from in_process import llmrun

from llmrun import tekken
from llmrun.errors import TokenizerError
from llmrun.tokenizer import Tokenizer

mistral_common = pytest.importorskip("mistral_common")
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy  # noqa: E402
from mistral_common.tokens.tokenizers.tekken import Tekkenizer  # noqa: E402

NEMO = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
RANKS = 3000  # the small file's plain tokens (its vocab lists more, which it cuts)
N_SPECIAL = 40
# A recent file's special tokens: Mistral's first twenty, fillers, then later ones.
SPECIALS = {
    **dict(enumerate(tekken.DEFAULT_SPECIALS)),
    32: "[ARGS]",
    33: "[CALL_ID]",
    34: "[THINK]",
    35: "[/THINK]",
}

TEXTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "def f(x):\n    return x ** 2 + 3.14159  # square\n\n\nprint(f(12))\n",
    "1234567890 12,345.67 -1e-9 0x1F 2024-07-18",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 🤖🎉👍🏽 and a family 👨\u200d👩\u200d👧",
    "Ünïcödé ÉLAN aÉb ΑΒΓ αβγ Привет МИР ǅemal",
    "हिन्दी पाठ और ภาษาไทย",
    "   leading spaces\tand\ttabs  \n\n\n  and trailing   ",
    "\u00a0\u2003\u3000 other spaces\r\n\r\n",
    " " * 40 + "after forty spaces",
    "[INST] special texts [/INST] <s> </s> [THINK] <SPECIAL_25> [IMG_BREAK] as text",
    "CamelCaseWORDS snake_case_words/paths/to/file.py?q=1&x=2",
    "",
]


def write_tekken(path: Path, **changes) -> Path:
    """A tekken.json of RANKS Nemo ranks (and 100 more it cuts), SPECIALS among N_SPECIAL
    special tokens; `changes` replace top-level keys (None: left out)."""
    nemo = _nemo()
    data = {
        "config": {
            **nemo["config"],
            "num_vocab_tokens": RANKS + 100,
            "default_vocab_size": RANKS + N_SPECIAL,
            "default_num_special_tokens": N_SPECIAL,
            "version": "v13",
        },
        "vocab": nemo["vocab"][: RANKS + 100],
        "special_tokens": [
            {"rank": i, "token_str": SPECIALS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
            for i in range(36)
        ],
    }
    data.update(changes)
    data = {k: v for k, v in data.items() if v is not None}
    path.mkdir(parents=True, exist_ok=True)
    (path / "tekken.json").write_text(json.dumps(data), encoding="utf-8")
    return path


@functools.cache
def _nemo() -> dict:
    return json.loads(NEMO.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = write_tekken(tmp_path_factory.mktemp("tekken"))
    return Tokenizer.from_hf_dir(folder), Tekkenizer.from_file(folder / "tekken.json")


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nemo")
    (folder / "tekken.json").write_bytes(NEMO.read_bytes())
    return Tokenizer.from_hf_dir(folder), Tekkenizer.from_file(folder / "tekken.json")


def mismatches(ours: Tokenizer, reference: Tekkenizer, texts: list[str]) -> list[str]:
    """The texts whose ids (BOS and EOS each added or not), decode or streamed pieces
    differ from mistral_common's."""
    bad = []
    for text, bos, eos in itertools.product(texts, (True, False), (True, False)):
        ids = ours.encode(text, add_bos=bos, parse_special=False)
        ids += [ours.eos_id] if eos else []
        expected = reference.encode(text, bos=bos, eos=eos)
        stream = ours.stream()
        pieces = "".join(map(stream.add, expected)) + stream.flush()
        keep = SpecialTokenPolicy.KEEP
        if text not in bad and (
            ids != expected
            or ours.decode(expected) != reference.decode(expected)
            or pieces != reference.decode(expected)
            or ours.decode(expected, skip_special=False) != reference.decode(expected, keep)
        ):
            bad.append(text)
    return bad


def test_ids_decode_and_pieces_are_mistral_commons(small):
    ours, reference = small
    assert ours.vocab_size == reference.n_words == RANKS + N_SPECIAL
    assert (ours.bos_id, ours.eos_id) == (reference.bos_id, reference.eos_id)
    assert ours.encode("Hello") == reference.encode("Hello", bos=True, eos=False)
    assert mismatches(ours, reference, TEXTS) == []
    expected = [reference.encode(t, bos=True, eos=False) for t in TEXTS]
    assert ours.encode_batch(TEXTS, parse_special=False, threads=1) == expected
    # Ids past the plain tokens are those of no text; mistral_common's cut vocabulary ends there.
    assert max(i for ids in expected for i in ids) < ours.vocab_size


def test_the_whole_nemo_vocabulary_is_mistral_commons(nemo):
    """The file mistral_common ships for Mistral Nemo: 130,072 of its 150,000 ranks after
    1,000 special tokens, the first twenty Mistral's own."""
    ours, reference = nemo
    assert ours.vocab_size == reference.n_words == 131072
    assert [ours.token_to_piece(i) for i in range(20)] == list(tekken.DEFAULT_SPECIALS)
    assert ours.token_to_piece(999) == "<SPECIAL_999>"
    assert mismatches(ours, reference, TEXTS) == []
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")[:30000]
    assert ours.encode(readme, parse_special=False) == reference.encode(readme, bos=True, eos=False)


def test_special_tokens_are_ids_where_special_tokens_parse(small):
    ours, reference = small
    text = "[INST] hi [/INST][THINK]x[/THINK]<SPECIAL_25></s>[INST"
    plain = [reference.encode(t, bos=False, eos=False) for t in (" hi ", "x", "[INST")]
    assert ours.encode(text) == [
        reference.bos_id, 3, *plain[0], 4, 34, *plain[1], 35, 25, reference.eos_id, *plain[2]
    ]  # fmt: skip
    assert ours.encode(text, parse_special=False) == reference.encode(text, bos=True, eos=False)
    assert ours.token_id("[THINK]") == 34 and ours.special_ids == set(range(N_SPECIAL))
    assert ours.eog_ids == {reference.eos_id}


def test_a_file_without_special_tokens_has_plain_ids_from_zero(tmp_path):
    config = {**_nemo()["config"], "default_vocab_size": RANKS, "version": "v13"}
    config["default_num_special_tokens"] = 0
    folder = write_tekken(tmp_path, config=config, special_tokens=[])
    ours, reference = Tokenizer.from_hf_dir(folder), Tekkenizer.from_file(folder / "tekken.json")
    assert (ours.bos_id, ours.eos_id, ours.special_ids) == (None, None, set())
    assert [ours.encode(t, add_bos=False) for t in TEXTS] == [
        reference.encode(t, bos=False, eos=False) for t in TEXTS
    ]


def test_a_planted_off_by_one_is_caught(small, tmp_path, monkeypatch):
    """The check fails where the plain tokens' ids are one off (one special token fewer)."""
    read = tekken._read

    def one_special_fewer(file):
        tokens, specials, pattern, size = read(file)
        return tokens, specials[:-1], pattern, size

    monkeypatch.setattr(tekken, "_read", one_special_fewer)
    wrong = Tokenizer.from_hf_dir(write_tekken(tmp_path))
    assert mismatches(wrong, small[1], TEXTS[:3]) == TEXTS[:3]


def test_tokenizer_json_wins_where_a_folder_has_both(tmp_path):
    import shutil

    from helpers import STORIES_HF

    folder = write_tekken(tmp_path / "both")
    shutil.copy(STORIES_HF / "tokenizer.json", folder / "tokenizer.json")
    assert Tokenizer.from_hf_dir(folder).vocab_size == 512
    (folder / "tokenizer.json").unlink()
    assert Tokenizer.from_hf_dir(folder).source == str(folder / "tekken.json")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"config": None}, "no config object"),
        ({"config": {"pattern": r"\w+"}}, "default_vocab_size"),
        ({"special_tokens": None}, "no special_tokens, which a file of version v13 must list"),
        ({"special_tokens": [{"rank": 1, "token_str": "<s>"}]}, "is not the one of rank 0"),
        ({"vocab": [{"rank": 0, "token_bytes": "AA=="}]}, "needs from 256 to 1 vocab entries"),
        ({"vocab": [{"rank": 0}] * 4000}, "a vocab entry is not a rank and its token_bytes"),
    ],
)
def test_a_broken_file_is_refused_in_one_line(tmp_path, changes, message):
    folder = write_tekken(tmp_path, **changes)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_hf_dir(folder)
    result = llmrun("tokenize", str(folder), "hi")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_a_token_listed_twice_or_misplaced_bytes_are_refused(tmp_path):
    vocab = _nemo()["vocab"][: RANKS + 100]
    twice = [*vocab[:300], {**vocab[300], "token_bytes": vocab[299]["token_bytes"]}, *vocab[301:]]
    with pytest.raises(TokenizerError, match="holds a token's bytes twice"):
        Tokenizer.from_hf_dir(write_tekken(tmp_path / "twice", vocab=twice))
    swapped = [{**vocab[1], "rank": 0}, {**vocab[0], "rank": 1}, *vocab[2:]]
    with pytest.raises(TokenizerError, match="ranks 0-255 are not the 256 bytes"):
        Tokenizer.from_hf_dir(write_tekken(tmp_path / "swapped", vocab=swapped))


def test_the_merges_and_tokens_are_the_gguf_converters(tmp_path):
    """gguf-py's MistralVocab (what llama.cpp's converter writes for a folder with only
    tekken.json): the same tokens at the same ids and the same merges in the same order;
    llmrun's tokenizer of that GGUF vocabulary ("tekken", llama.cpp's approximation of the
    pattern) gives the folder's ids where the two split text alike."""
    from gguf import Keys
    from gguf.vocab import MistralVocab

    folder = write_tekken(tmp_path)
    vocab = MistralVocab(folder)
    tokens, scores, types = zip(*vocab.all_tokens(), strict=True)
    ours = Tokenizer.from_hf_dir(folder)
    assert [ours.token_id(t.decode()) for t in tokens] == list(range(len(tokens)))
    merges = vocab.extract_vocab_merges_from_model()
    spelled, ours_merges = tekken.byte_level_vocabulary(tekken._read(folder / "tekken.json")[0])
    assert [t.decode() for t in tokens[N_SPECIAL:]] == spelled
    assert merges == ours_merges
    metadata = {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.PRE: "tekken",
        Keys.Tokenizer.LIST: [t.decode() for t in tokens],
        Keys.Tokenizer.TOKEN_TYPE: [int(t) for t in types],
        Keys.Tokenizer.MERGES: merges,
        Keys.Tokenizer.BOS_ID: vocab.bos_id,
        Keys.Tokenizer.EOS_ID: vocab.eos_id,
        Keys.Tokenizer.ADD_BOS: True,
    }
    gguf = Tokenizer.from_gguf_metadata(metadata, "converted.gguf")
    # Not the Devanagari and Thai, whose combining marks llama.cpp's regex leaves out of
    # letters (benchmarks/tekken.py: its ids part there with Nemo's whole vocabulary).
    alike = [t for t in TEXTS if "\u093f" not in t]
    assert len(alike) == len(TEXTS) - 1
    assert [gguf.encode(t) for t in alike] == [ours.encode(t) for t in alike]


def test_a_folder_with_only_tekken_json_runs_end_to_end(tmp_path):
    """A tiny Mistral model: `run` feeds mistral_common's ids and prints transformers'
    greedy tokens as mistral_common decodes them, with a chat template too (whose [INST]
    and [/INST] are their ids, as mistral_common lays out a user turn); `show` names the
    tokenizer."""
    hf, _ = tiny_hf_model("mistral", vocab_size=RANKS + N_SPECIAL)
    folder = write_tekken(save_hf_dir(hf, tmp_path / "model"))
    reference = Tekkenizer.from_file(folder / "tekken.json")
    prompt = "Once upon a time, 日本語 🤖"
    plain = reference.encode(prompt, bos=False, eos=False)
    templated = [reference.bos_id, 3, *plain, 4]

    def check(ids: list[int]) -> None:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
        new = out[0, len(ids) :].tolist()
        run = ["run", str(folder), prompt, "-n", "10", "--temperature", "0"]
        result = llmrun(*run, "--json", "--logprobs", "1")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["prompt_tokens"] == len(ids)
        assert [entry["id"] for entry in data["logprobs"]] == new
        assert data["text"] == reference.decode(new)

    check([reference.bos_id, *plain])
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"
    )
    check(templated)
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    assert "BPE (tekken.json)" in shown.stdout
