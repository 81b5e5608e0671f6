"""Beam search of text-to-text models (llmrun.beam_search, through llmrun.text_to_text)
against transformers' generate with num_beams > 1, on tiny random BART, flan-T5 and Marian
(tests/bart_helpers.py, t5_helpers.py, marian_helpers.py), their </s> made likelier (its
output bias or head row raised alike on both sides) so that beams end early, at different
steps: the ids equal generate's for 2 to 4 beams, length penalties of 2, 0.5 and -1,
early_stopping True, False and "never", with no_repeat_ngram_size, min_length and
repetition_penalty (run's --repeat-penalty, applied per beam as transformers does), beside
each file's own rules (bart-large-cnn's forced <s>, Marian's banned <pad>, </s> forced
last). A length penalty ignored (the planted bug) fails. `run` decodes as transformers'
pipeline does (the file's num_beams unless --beams or sampling says otherwise) and refuses
what beams cannot do in one error line; serve's completion endpoints take num_beams, and
their n choices are generate's num_return_sequences, from one search.

Tolerances: ids and text exact.
"""

import json

import pytest
import torch
from in_process import llmrun
from serving import served

from llmrun import api, beam_search
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

NEW_TOKENS = 24
SETTINGS = [
    {"num_beams": 2, "length_penalty": 1.0, "early_stopping": False},
    {"num_beams": 3, "length_penalty": 2.0, "early_stopping": True},
    {"num_beams": 4, "length_penalty": 0.5, "early_stopping": "never", "no_repeat_ngram_size": 2},
    {"num_beams": 4, "length_penalty": -1.0, "early_stopping": False, "min_length": 10},
    {"num_beams": 3, "early_stopping": True, "repetition_penalty": 1.5},
]
# bart-large-cnn's kind of generation_config.json: beams and its rules
CNN = {
    "num_beams": 3,
    "length_penalty": 2.0,
    "early_stopping": True,
    "no_repeat_ngram_size": 3,
    "min_length": 12,
}


def _family(name, root):
    """(folder, transformers' model, its tokenizer, the prompt, </s>'s id, and a function
    that raises </s>'s logit in a model of the family)."""
    if name == "bart":
        from bart_helpers import PROMPT, bart_folder, reference

        folder = bart_folder(root, "bart")
        ref = reference(folder, "bart")
        eos = 2

        def boost(model):
            model.final_logits_bias[0, eos] += 3.5

    elif name == "t5":
        from t5_helpers import PROMPT, reference, t5_folder, tokenizer_folder

        folder = t5_folder(root / "flan", "flan", tokenizer_folder(root / "tokenizer"))
        ref = reference(folder)
        eos = 1

        def boost(model):
            model.lm_head.weight[eos] *= 3.0

    else:
        from marian_helpers import PROMPT, marian_folder, reference

        folder = marian_folder(root)
        ref = reference(folder)
        eos = 0

        def boost(model):
            model.final_logits_bias[0, eos] += 3.0

    return folder, ref, transformers.AutoTokenizer.from_pretrained(folder), PROMPT, eos, boost


@pytest.fixture(scope="module", params=["bart", "t5", "marian"])
def family(request, tmp_path_factory):
    """(name, transformers' model, its tokenizer, llmrun's engine and its
    generation_config.json, the prompt, its ids)."""
    folder, ref, tokenizer, prompt, _, boost = _family(
        request.param, tmp_path_factory.mktemp(request.param)
    )
    engine = api.load(str(folder), text_to_text=True)
    with torch.no_grad():
        boost(ref)
        boost(engine.model)
    generation = dict(engine.checkpoint.generation_config)
    return request.param, ref, tokenizer, engine, generation, prompt, tokenizer(prompt).input_ids


def _beams(engine, generation, prompt, setting, monkeypatch):
    """llmrun's text and token count (the </s> it ended at counted) under the file's
    `generation` rules and `setting`."""
    setting = dict(setting)
    params = SamplingParams(temperature=0.0, repeat_penalty=setting.pop("repetition_penalty", 1.0))
    monkeypatch.setattr(engine.checkpoint, "generation_config", {**generation, **setting})
    ids = engine.tokenizer.encode(prompt)
    responses = list(engine.generate(ids, params, NEW_TOKENS))
    text = "".join(r.text for r in responses)
    return text, responses[-1].stats.completion_tokens


def _expected(ref, tokenizer, ids, setting):
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, **setting
        )[0]
    return tokenizer.decode(out, skip_special_tokens=True), len(out) - 1


def test_beams_are_transformers_generate(family, monkeypatch):
    name, ref, tokenizer, engine, generation, prompt, ids = family
    lengths = []
    for setting in SETTINGS:
        text, count = _expected(ref, tokenizer, ids, setting)
        assert _beams(engine, generation, prompt, setting, monkeypatch) == (text, count), setting
        lengths.append(count)
    assert min(lengths) < NEW_TOKENS  # some searches ended before the limit
    if name == "bart":  # the planted bug: hypotheses scored without the length penalty
        of = beam_search.Beams.of

        def ignored(generation, config):
            return beam_search.Beams(**{**of(generation, config).__dict__, "length_penalty": 1.0})

        monkeypatch.setattr(beam_search.Beams, "of", ignored)
        wrong = [_beams(engine, generation, prompt, s, monkeypatch) for s in SETTINGS]
        assert wrong != [_expected(ref, tokenizer, ids, s) for s in SETTINGS]


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A BART folder whose generation_config.json asks for beams (CNN), </s> raised in its
    weights; transformers' model of it, its tokenizer, the prompt's ids."""
    from bart_helpers import PROMPT

    folder, ref, tokenizer, _, _, boost = _family("bart", tmp_path_factory.mktemp("cnn"))
    with torch.no_grad():
        boost(ref)
    ref.save_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, **CNN}))
    ref = transformers.BartForConditionalGeneration.from_pretrained(folder).eval()
    return folder, ref, tokenizer, tokenizer(PROMPT).input_ids


def _generate(ref, ids, **kw):
    with torch.no_grad():
        return ref.generate(torch.tensor([ids]), max_new_tokens=16, **kw)[0]


def test_run_decodes_as_transformers_pipeline(cnn):
    from bart_helpers import PROMPT

    folder, ref, tokenizer, ids = cnn
    by_file = tokenizer.decode(_generate(ref, ids), skip_special_tokens=True)  # 3 beams
    greedy = tokenizer.decode(_generate(ref, ids, num_beams=1), skip_special_tokens=True)
    two = _generate(ref, ids, num_beams=2)
    assert len({by_file, greedy, tokenizer.decode(two, skip_special_tokens=True)}) == 3
    result = llmrun("run", str(folder), PROMPT, "-n", "16")
    assert (result.returncode, result.stderr, result.stdout) == (0, "", by_file)
    with torch.no_grad():  # without -n: the file's max_length, as generate's
        whole = ref.generate(torch.tensor([ids]))[0]
    assert len(whole) > 17
    assert llmrun("run", str(folder), PROMPT).stdout == tokenizer.decode(
        whole, skip_special_tokens=True
    )
    assert llmrun("run", str(folder), PROMPT, "-n", "16", "--beams", "1").stdout == greedy
    result = llmrun("run", str(folder), PROMPT, "-n", "16", "--beams", "2", "--json")
    record = json.loads(result.stdout)
    assert record["text"] == tokenizer.decode(two, skip_special_tokens=True)
    assert record["completion_tokens"] == len(two) - 1
    assert record["finish_reason"] == ("stop" if two[-1] == 2 else "length")


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--beams", "2", "--temperature", "0.7"],
            "error: beam search (2 beams) does not sample: it goes with temperature 0 (beam "
            "sampling is not done); ask for 1 beam to sample\n",
        ),
        (
            ["--json", "--logprobs", "2"],
            "error: logprobs: not with beam search (3 beams); ask for 1 beam\n",
        ),
        (["--beams", "40"], "error: the number of beams must be between 1 and 32, got 40\n"),
    ],
    ids=["sampling", "logprobs", "too-many"],
)
def test_what_beams_cannot_do_is_one_error_line(cnn, flags, message):
    result = llmrun("run", str(cnn[0]), "hello", *flags)
    assert (result.returncode, result.stderr) == (2, message)


def test_beams_go_with_text_to_text_models_alone():
    result = llmrun("run", "hello", "--beams", "2", "-n", "2")  # the bundled stories260K
    assert result.returncode == 2
    assert result.stderr == (
        "error: --beams, --source-language and --target-language go with a text-to-text model "
        "(T5, BART, Marian, M2M100, ...), --beams with a speech recognition model too; not "
        "stories260K (bundled)\n"
    )


def test_serve_takes_num_beams(cnn):
    from bart_helpers import PROMPT

    folder, ref, tokenizer, ids = cnn
    texts = {
        n: tokenizer.decode(_generate(ref, ids, num_beams=n), skip_special_tokens=True)
        for n in (1, 2, 3)
    }
    engine = api.load(str(folder), device="cpu", generate=False)
    for client in served(engine, "bart"):
        body = {"model": "bart", "prompt": PROMPT, "max_tokens": 16}
        answers = {
            None: client.post("/v1/completions", json=body),  # the file's 3 beams
            1: client.post("/v1/completions", json={**body, "num_beams": 1}),
            2: client.post("/completion", json={**body, "num_beams": 2}),
            3: client.post(
                "/api/generate",
                json={
                    "model": "bart",
                    "prompt": PROMPT,
                    "stream": False,
                    "options": {"num_predict": 16, "num_beams": 3},
                },
            ),  # fmt: skip
        }
        got = {n: a.json() for n, a in answers.items()}
        assert got[None]["choices"][0]["text"] == texts[3]
        assert got[1]["choices"][0]["text"] == texts[1]
        assert got[2]["content"] == texts[2]
        assert got[3]["response"] == texts[3]
        refused = client.post("/v1/completions", json={**body, "num_beams": 2, "temperature": 0.5})
        assert refused.status_code == 400
        assert "does not sample" in refused.json()["error"]["message"]


def test_serve_refuses_num_beams_for_a_decoder_only_model():
    for client in served(api.load(device="cpu"), "stories"):
        body = {"model": "stories", "prompt": "Once", "max_tokens": 2, "num_beams": 2}
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == (
            "num_beams: only a text-to-text model (T5, BART, Marian, M2M100, ...) takes it, "
            "not stories260K (bundled)"
        )


def test_serve_s_n_choices_are_the_best_hypotheses(cnn, monkeypatch):
    """n > 1 with beams: transformers' num_return_sequences, best first, of one search;
    more than the beams is a 400."""
    from bart_helpers import PROMPT

    folder, ref, tokenizer, ids = cnn
    expected = {
        (beams, n): tokenizer.batch_decode(
            _generate_all(ref, ids, num_beams=beams, num_return_sequences=n),
            skip_special_tokens=True,
        )
        for beams, n in ((2, 2), (3, 3), (3, 2))
    }
    assert len(set(expected[3, 3])) == 3
    searches = []
    search = beam_search.search
    monkeypatch.setattr(beam_search, "search", lambda *a: searches.append(a) or search(*a))
    engine = api.load(str(folder), device="cpu", generate=False)
    for client in served(engine, "bart"):
        body = {"model": "bart", "prompt": PROMPT, "max_tokens": 16}
        for extra, beams, n in (({}, 3, 3), ({"num_beams": 2}, 2, 2), ({}, 3, 2)):
            del searches[:]
            answer = client.post("/v1/completions", json={**body, **extra, "n": n})
            assert [c["text"] for c in answer.json()["choices"]] == expected[beams, n]
            assert len(searches) == 1, (beams, n)
        refused = client.post("/v1/completions", json={**body, "n": 4})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == (
            "n: 4 choices, and a beam search of 3 beams finishes 3 hypotheses; ask for up to "
            "3, or for more beams"
        )


def _generate_all(ref, ids, **kw):
    with torch.no_grad():
        return ref.generate(torch.tensor([ids]), max_new_tokens=16, **kw)
