"""Source and target languages of many-to-many translators (llmrun.translation, through
llmrun.text_to_text) against transformers: NLLB tokenizers saved by transformers'
NllbTokenizer (a small SentencePiece BPE trained here, the language codes special tokens)
frame the prompt as NllbTokenizer with src_lang set frames it (the code before the text, or
after </s> in its legacy layout), M2M100's __xx__ codes are named without underscores as
M2M100Tokenizer names them, and a tiny random M2M100 (tests/bart_helpers.py) with the NLLB
tokenizer translates as generate with forced_bos_token_id the target's code does, through
`run` (greedy and beams) and serve's /v1/completions. Unknown codes, and languages for a
model without codes, are one error line naming what it takes.

Tolerances: ids and text exact.
"""

import json

import pytest
import torch
from bart_helpers import PROMPT, bart_folder, reference
from in_process import llmrun
from serving import served
from unigram_helpers import CORPUS

from llmrun import api
from llmrun.tokenizer import load_tokenizer
from llmrun.translation import Framing

transformers = pytest.importorskip("transformers")
CODES = ["eng_Latn", "deu_Latn", "fra_Latn"]


def nllb_tokenizer(path, codes=CODES, legacy=False):
    """NllbTokenizer's files at `path`: a 280-piece SentencePiece BPE and `codes`."""
    from tokenizers import SentencePieceBPETokenizer

    bpe = SentencePieceBPETokenizer()
    bpe.train_from_iterator(
        CORPUS * 4,
        vocab_size=280,
        min_frequency=1,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
    )
    model = json.loads(bpe.to_str())["model"]
    transformers.NllbTokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        extra_special_tokens=codes,
        src_lang=codes[0],
        legacy_behaviour=legacy,
    ).save_pretrained(path)
    return path


@pytest.mark.parametrize("legacy", [False, True], ids=["prefix", "legacy"])
def test_source_language_frames_as_nllb_tokenizer(tmp_path, legacy):
    folder = nllb_tokenizer(tmp_path, legacy=legacy)
    frame = Framing.of(load_tokenizer(folder))
    plain = load_tokenizer(folder).encode(PROMPT, add_bos=False)
    for code in CODES:
        expected = transformers.NllbTokenizer.from_pretrained(folder, src_lang=code)
        source = frame.code_id(code, "nllb", "source")
        assert frame.ids(plain, source) == expected(PROMPT).input_ids


def test_m2m100_codes_are_named_without_underscores(tmp_path):
    folder = nllb_tokenizer(tmp_path, codes=["__en__", "__de__", "__fr__"])
    frame = Framing.of(load_tokenizer(folder))
    expected = transformers.NllbTokenizer.from_pretrained(folder, src_lang="__fr__")
    assert frame.code_id("fr", "m2m", "source") == frame.code_id("__fr__", "m2m", "source")
    plain = load_tokenizer(folder).encode(PROMPT, add_bos=False)
    assert frame.ids(plain, frame.code_id("fr", "m2m", "source")) == expected(PROMPT).input_ids


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    """A tiny random M2M100 with an NLLB tokenizer (no forced first token, as NLLB's files
    have none; no repeated bigram); transformers' model, NllbTokenizer for French sources,
    German's id."""
    folder = bart_folder(tmp_path_factory.mktemp("nllb"), "m2m_100")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    nllb_tokenizer(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    del generation["forced_bos_token_id"]
    generation["no_repeat_ngram_size"] = 2  # the random model would repeat one token
    (folder / "generation_config.json").write_text(json.dumps(generation))
    tokenizer = transformers.NllbTokenizer.from_pretrained(folder, src_lang="fra_Latn")
    model = reference(folder, "m2m_100")
    model.resize_token_embeddings(len(tokenizer))  # every id a piece of the tokenizer
    model.save_pretrained(folder)
    return folder, model, tokenizer, tokenizer.convert_tokens_to_ids("deu_Latn")


def _translation(nllb, **kw):
    _, ref, tokenizer, target = nllb
    with torch.no_grad():
        out = ref.generate(
            tokenizer(PROMPT, return_tensors="pt").input_ids,
            forced_bos_token_id=target,
            max_new_tokens=12,
            **kw,
        )[0]
    assert out[1] == target and len(set(out.tolist())) > 4
    return tokenizer.decode(out, skip_special_tokens=True)


def test_run_translates_as_transformers_generate(nllb):
    folder = nllb[0]
    languages = ["--source-language", "fra_Latn", "--target-language", "deu_Latn"]
    result = llmrun("run", str(folder), PROMPT, "-n", "12", *languages)
    assert (result.returncode, result.stderr) == (0, "")
    greedy = _translation(nllb, num_beams=1)
    assert result.stdout == greedy
    result = llmrun("run", str(folder), PROMPT, "-n", "12", "--beams", "3", *languages)
    assert result.stdout == _translation(nllb, num_beams=3) != greedy
    result = llmrun("run", str(folder), PROMPT, "--source-language", "xx", "-n", "2")
    assert (result.returncode, result.stderr) == (
        2,
        f"error: unknown source language 'xx' for {folder}: its codes are deu_Latn, "
        "eng_Latn, fra_Latn\n",
    )


def test_a_model_without_codes_takes_no_language(tmp_path):
    folder = bart_folder(tmp_path / "bart", "bart")
    result = llmrun("run", str(folder), PROMPT, "--target-language", "de", "-n", "2")
    assert (result.returncode, result.stderr) == (
        2,
        f"error: {folder} has no language codes to choose a target language by (mBART-50, "
        "NLLB and M2M100 translators have them)\n",
    )


def test_serve_takes_source_and_target_languages(nllb):
    engine = api.load(str(nllb[0]), device="cpu", generate=False)
    for client in served(engine, "nllb"):
        body = {"model": "nllb", "prompt": PROMPT, "max_tokens": 12}
        languages = {"source_language": "fra_Latn", "target_language": "deu_Latn"}
        answer = client.post("/v1/completions", json={**body, **languages})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == _translation(nllb, num_beams=1)
        refused = client.post("/v1/completions", json={**body, "target_language": "klingon"})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith(
            f"unknown target language 'klingon' for {nllb[0]}: its codes are"
        )


def test_mbart_with_its_code_after_the_text_takes_no_target_language(tmp_path):
    """MBartTokenizer's layout (mbart-large-cc25 and its fine-tunes): the target language
    is the decoder's start token there, which a forced first token would repeat."""
    from llmrun.errors import UsageError
    from llmrun.sampling import SamplingParams
    from llmrun.text_to_text import Options, Plan

    tokenizer = load_tokenizer(nllb_tokenizer(tmp_path, legacy=True))
    options = Options(source_language="deu_Latn", target_language="fra_Latn")
    greedy = SamplingParams(temperature=0.0)
    assert Plan.of({}, {"model_type": "m2m_100"}, tokenizer, "m", greedy, None, options).source
    with pytest.raises(UsageError, match="its target language is its decoder_start_token_id"):
        Plan.of({}, {"model_type": "mbart"}, tokenizer, "m", greedy, None, options)


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_a_multilingual_marian_takes_its_target_token_first(tmp_path):
    """opus-mt's multilingual models: --target-language (or serve's target_language) puts
    the >>xxx<< token before the text, as MarianTokenizer encodes ">>deu<< text"."""
    from marian_helpers import LANGUAGE_CODE, marian_folder
    from marian_helpers import PROMPT as MARIAN_PROMPT
    from marian_helpers import reference as marian_reference

    folder = marian_folder(tmp_path / "marian")
    ref = marian_reference(folder)
    tokenizer = transformers.MarianTokenizer.from_pretrained(folder)

    def translated(text):
        ids = tokenizer(text).input_ids
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=12, num_beams=1)
        return ids, tokenizer.decode(out[0], skip_special_tokens=True)

    ids, expected = translated(f"{LANGUAGE_CODE} {MARIAN_PROMPT}")
    assert ids[0] == tokenizer.convert_tokens_to_ids(LANGUAGE_CODE)
    assert expected != translated(MARIAN_PROMPT)[1]
    for name in ("deu", LANGUAGE_CODE):
        result = llmrun("run", str(folder), MARIAN_PROMPT, "-n", "12", "--target-language", name)
        assert (result.returncode, result.stdout) == (0, expected)
    result = llmrun("run", str(folder), MARIAN_PROMPT, "--target-language", "fra")
    assert (result.returncode, result.stderr) == (
        2,
        f"error: unknown target language 'fra' for {folder}: its codes are >>deu<<\n",
    )
    for client in served(api.load(str(folder), device="cpu", generate=False), "marian"):
        body = {"model": "marian", "prompt": MARIAN_PROMPT, "max_tokens": 12}
        answer = client.post("/v1/completions", json={**body, "target_language": "deu"})
        assert answer.json()["choices"][0]["text"] == expected
