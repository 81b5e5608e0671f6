"""BART, mBART and M2M100 (NLLB) text-to-text folders (llmrun.models.bart,
llmrun.text_to_text) against transformers, on tiny random BartForConditionalGeneration,
MBartForConditionalGeneration and M2M100ForConditionalGeneration (tests/bart_helpers.py):
the prompt framed as their tokenizers frame it (<s> ... </s>, en_XX ... </s>), the encoder
output and decoder logits (prefilled, then a token a step through the KV cache)
transformers', and greedy decoding generate's ids (num_beams=1) under
their generation_config.json: bart-large-cnn's forced <s> first, min_length and
no_repeat_ngram_size 3, the translators' forced de_DE first, all </s> forced last. Learned
positions read without their offset of 2 (the planted bug) fail. `run` prints generate's
text, `show` names the model.

Tolerances: encoder output and logits 1e-4; ids and text exact.
"""

import pytest
import torch
from bart_helpers import PROMPT, VARIANTS, bart_folder, reference
from in_process import llmrun

from llmrun import api
from llmrun.models import bart as bart_model
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, folder, transformers' model, its tokenizer, llmrun's engine, the prompt's ids)."""
    folder = bart_folder(tmp_path_factory.mktemp(request.param), request.param)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    engine = api.load(str(folder), text_to_text=True)
    ids = tokenizer(PROMPT).input_ids
    return request.param, folder, reference(folder, request.param), tokenizer, engine, ids


def _logits(model, encoded, decoder_ids):
    """llmrun's decoder logits of decoder_ids [1, T]: 5 prefilled, then one a step."""
    decoding = model.decoding(encoded)
    cache = model.new_cache(1, 32, torch.float32, torch.device("cpu"))
    steps = [decoding(decoder_ids[:, :5], torch.arange(5)[None], cache)]
    for i in range(5, decoder_ids.shape[1]):
        steps.append(decoding(decoder_ids[:, i : i + 1], torch.tensor([[i]]), cache))
    return torch.cat(steps, dim=1)


def test_encoder_and_decoder_match_transformers(variant, monkeypatch):
    _, _, ref, _, engine, ids = variant
    prompt = torch.tensor([ids])
    decoder_ids = torch.tensor([[2, *range(5, 25)]])
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=decoder_ids)
        encoded = engine.model.encode(prompt)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        logits = _logits(engine.model, encoded, decoder_ids)
        assert (logits - expected.logits).abs().max() < 1e-4
        monkeypatch.setattr(bart_model, "POSITION_OFFSET", 0)  # the planted bug
        wrong = _logits(engine.model, engine.model.encode(prompt), decoder_ids)
        assert (wrong - expected.logits).abs().max() > 1e-2


def test_greedy_decoding_is_transformers_generate(variant):
    name, _, ref, _, engine, ids = variant
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=20
        )[0]
    expected = expected[1:].tolist()  # without decoder_start_token_id
    assert expected[0] == ref.generation_config.forced_bos_token_id and expected[-1] == 2
    assert len(set(expected)) > 3
    prompt = engine.tokenizer.encode(PROMPT)  # as `run` encodes it: framed by text_to_text
    responses = list(engine.generate(prompt, SamplingParams(temperature=0.0), 20))
    tokens = [r.token for r in responses if r.token is not None]
    assert responses[-1].finish_reason == "stop"
    assert tokens + [2] == expected  # generate keeps the </s> it stopped at
    assert responses[-1].stats.prompt_tokens == len(ids)  # framed as the tokenizer frames it


def test_run_prints_generates_text_and_show_names_it(variant):
    name, folder, ref, tokenizer, _, ids = variant
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=12
        )
    text = tokenizer.decode(expected[0], skip_special_tokens=True)
    result = llmrun("run", str(folder), PROMPT, "-n", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == text  # a pipe gets the text exactly
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    assert f"{name} (text-to-text (encoder-decoder): 2 encoder and 2 decoder layers)" in (
        shown.stdout
    )


def test_a_bad_word_of_several_tokens_is_one_error_line(variant, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(variant[1], tmp_path / "model")
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["bad_words_ids"] = [[5, 6]]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    result = llmrun("run", str(folder), PROMPT, "-n", "4")
    assert result.returncode != 0
    assert result.stderr == (
        "error: generation_config.json's bad_words_ids holds a word of several tokens, which "
        "llmrun does not apply\n"
    )


@pytest.mark.parametrize("variant", ["m2m_100"], indirect=True)
def test_m2m100_tokenizers_own_files_are_refused(variant, tmp_path):
    """facebook/m2m100_*'s folders hold no tokenizer.json: their sentencepiece.bpe.model
    beside vocab.json is not read as XLM-RoBERTa's, which gives other ids."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((variant[1] / name).read_bytes())
    (folder / "sentencepiece.bpe.model").write_bytes(b"")  # refused before it is read
    (folder / "vocab.json").write_text("{}")
    result = llmrun("run", str(folder), PROMPT)
    assert result.returncode != 0
    assert result.stderr == (
        f"error: {folder / 'sentencepiece.bpe.model'} with vocab.json (M2M100Tokenizer's) "
        "is not supported: a folder with tokenizer.json is\n"
    )
