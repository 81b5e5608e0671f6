"""Marian translation folders (llmrun.models.bart, llmrun.marian_tokenizer,
llmrun.text_to_text) against transformers, on a tiny random MarianMTModel
(tests/marian_helpers.py): the tokenizer gives MarianTokenizer's ids (source.spm pieces
looked up in vocab.json, special-token text, a ">>deu<<" language code) and decodes as it
does; the encoder output and decoder logits (prefilled, then a token a step through the KV
cache) are transformers'; greedy decoding gives generate's ids, <pad> banned and </s> forced
at the last step as generation_config.json says. Interleaved sinusoids (XLM's layout, the
planted bug) fail. `run` prints generate's text, `show` names the model, and serve's
/v1/completions answers it.

Tolerances: encoder output and logits 1e-4; ids and text exact.
"""

import pytest
import torch
from in_process import llmrun
from marian_helpers import LANGUAGE_CODE, PROMPT, marian_folder, reference
from serving import served
from unigram_helpers import CORPUS, TEXTS

from llmrun import api
from llmrun.models import bart as bart_model
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
# MarianTokenizer without sacremoses (llmrun's, which applies no Moses normalization).
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """(folder, transformers' model, its tokenizer, llmrun's engine, the prompt's ids)."""
    folder = marian_folder(tmp_path_factory.mktemp("marian"))
    tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
    engine = api.load(str(folder), text_to_text=True)
    return folder, reference(folder), tokenizer, engine, tokenizer(PROMPT).input_ids


def test_tokenizer_is_marian_tokenizers(marian):
    _, _, expected, engine, _ = marian
    texts = [*TEXTS, *CORPUS, f"{LANGUAGE_CODE} Hello world", "a</s>b<pad> x <unk>"]
    for text in texts:
        ids = expected(text).input_ids
        assert engine.tokenizer.encode_sequence(text) == ids, text
        if not text.startswith("\ufb01"):  # "ﬁne ① ...": MarianTokenizer strips the end too
            assert engine.tokenizer.decode(ids) == expected.decode(ids, skip_special_tokens=True)


def _logits(model, encoded, decoder_ids):
    """llmrun's decoder logits of decoder_ids [1, T]: 5 prefilled, then one a step."""
    decoding = model.decoding(encoded)
    cache = model.new_cache(1, 32, torch.float32, torch.device("cpu"))
    steps = [decoding(decoder_ids[:, :5], torch.arange(5)[None], cache)]
    for i in range(5, decoder_ids.shape[1]):
        steps.append(decoding(decoder_ids[:, i : i + 1], torch.tensor([[i]]), cache))
    return torch.cat(steps, dim=1)


def test_encoder_and_decoder_match_transformers(marian, monkeypatch):
    _, ref, _, engine, ids = marian
    prompt = torch.tensor([ids])
    decoder_ids = torch.tensor([[ref.config.decoder_start_token_id, *range(5, 25)]])
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=decoder_ids)
        encoded = engine.model.encode(prompt)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        logits = _logits(engine.model, encoded, decoder_ids)
        assert (logits - expected.logits).abs().max() < 1e-4

        right = bart_model.sinusoidal_positions

        def interleaved(positions, dim):  # the planted bug: XLM's sin, cos, sin, cos, ...
            table = right(positions, dim)
            half = dim // 2
            return torch.stack([table[..., :half], table[..., half:]], dim=-1).flatten(-2)

        monkeypatch.setattr(bart_model, "sinusoidal_positions", interleaved)
        wrong = _logits(engine.model, engine.model.encode(prompt), decoder_ids)
        assert (wrong - expected.logits).abs().max() > 1e-2


def test_greedy_decoding_is_transformers_generate(marian):
    _, ref, _, engine, ids = marian
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0]
    expected = expected[1:].tolist()  # without decoder_start_token_id
    assert expected[-1] == 0 and len(set(expected)) > 3  # </s> forced, the tokens varied
    responses = list(engine.generate(ids[:-1], SamplingParams(temperature=0.0), 16))
    tokens = [r.token for r in responses if r.token is not None]
    assert responses[-1].finish_reason == "stop"
    assert tokens + [0] == expected  # generate keeps the </s> it stopped at
    assert responses[-1].stats.prompt_tokens == len(ids)  # the encoder's, with </s>


def test_run_show_and_serve(marian):
    folder, ref, tokenizer, engine, ids = marian
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)
    text = tokenizer.decode(expected[0], skip_special_tokens=True)
    result = llmrun("run", str(folder), PROMPT, "-n", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == text  # a pipe gets the text exactly
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    assert "marian (text-to-text (encoder-decoder): 2 encoder and 2 decoder layers)" in (
        shown.stdout
    )
    for client in served(engine, "marian"):
        body = {"model": "marian", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == text
