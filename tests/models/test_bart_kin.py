"""PEGASUS, PEGASUS-X, Blenderbot, Blenderbot Small, MVP and LED text-to-text folders
(llmrun.models.bart's LAYOUTS, llmrun.models.pegasus_x, llmrun.text_to_text) against
transformers, on tiny random models of each (tests/bart_kin_helpers.py): the tokenizer gives
their tokenizer classes' ids (PEGASUS's Unigram, ... </s>; Blenderbot's vocab.json and
merges.txt, nothing around; MVP's and LED's <s> ... </s>), the encoder output and decoder
logits (prefilled, then a token a step through the KV cache) are transformers', and greedy
decoding gives generate's ids (num_beams=1) under their generation_config.json. Each
family's departure from BART, planted wrong (PEGASUS's sinusoids as M2M100's, PEGASUS-X's
blocks not staggered, Blenderbot's positions read two rows on, Blenderbot Small's decoder
embedding as its encoder's, MVP's positions read from row 0, LED's windows as wide as the
source), fails. `run` prints generate's text, `show` names the family, serve's
/v1/completions answers PEGASUS-X (its own model file); a PEGASUS spiece.model alone is
refused, so is MVP with prompts; Blenderbot's encoder_no_repeat_ngram_size is generate's
(greedy and beams; sampled replies repeat no source n-gram).

Tolerances: encoder output and logits 1e-4; ids and text exact.
"""

import dataclasses
import json
import shutil

import pytest
import torch
from bart_kin_helpers import FAMILIES, PROMPT, kin_folder, reference
from in_process import llmrun
from serving import served
from unigram_helpers import TEXTS

from llmrun import api, text_to_text
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

# family -> its planted bug: the model args' fields it changes
PLANTED = {
    "pegasus": lambda args: {"layout": dataclasses.replace(args.layout, positions="fairseq")},
    "pegasus_x": lambda args: {"stagger_local_blocks": False},
    "blenderbot": lambda args: {"layout": dataclasses.replace(args.layout, offset=True)},
    "blenderbot-small": lambda args: {
        "layout": dataclasses.replace(args.layout, decoder_norms_tokens=False)
    },
    "mvp": lambda args: {"layout": dataclasses.replace(args.layout, offset=False)},
    "led": lambda args: {"windows": [64] * len(args.windows)},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, folder, transformers' model, its tokenizer, llmrun's engine, the prompt's ids)."""
    folder = kin_folder(tmp_path_factory.mktemp(request.param), request.param)
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


def test_tokenizer_encoder_and_decoder_match_transformers(family, monkeypatch):
    name, _, ref, tokenizer, engine, ids = family
    for text in [PROMPT, *TEXTS[:8], "</s> and <unk> as text"]:
        assert engine.tokenizer.encode_sequence(text) == tokenizer(text).input_ids, text
    prompt = torch.tensor([ids])
    decoder_ids = torch.tensor([[ref.config.decoder_start_token_id, *range(5, 25)]])
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=decoder_ids)
        model = engine.model
        encoded = model.encode(prompt)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        logits = _logits(model, encoded, decoder_ids)
        assert (logits - expected.logits).abs().max() < 1e-4
        for field, wrong in PLANTED[name](model.args).items():
            monkeypatch.setattr(model.args, field, wrong)
        wrong_logits = _logits(model, model.encode(prompt), decoder_ids)
        assert (wrong_logits - expected.logits).abs().max() > 1e-2


def test_greedy_decoding_is_transformers_generate(family):
    _, _, ref, _, engine, ids = family
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=20
        )[0]
    expected = expected[1:].tolist()  # without decoder_start_token_id
    assert len(expected) >= 8 and len(set(expected)) > 3
    prompt = engine.tokenizer.encode(PROMPT)  # as `run` encodes it: framed by text_to_text
    responses = list(engine.generate(prompt, SamplingParams(temperature=0.0), 20))
    tokens = [r.token for r in responses if r.token is not None]
    end = ref.config.eos_token_id
    assert tokens + [end] == expected if expected[-1] == end else tokens == expected
    assert responses[-1].stats.prompt_tokens == len(ids)  # framed as the tokenizer frames it


def test_run_prints_generates_text_and_show_names_it(family):
    name, folder, ref, tokenizer, _, ids = family
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
    if name == "pegasus_x":
        for client in served(family[4], name):
            body = {"model": name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text


@pytest.mark.parametrize("family", ["pegasus"], indirect=True)
def test_pegasus_spiece_model_alone_is_refused(family, tmp_path):
    """A PEGASUS folder without tokenizer.json: its spiece.model is not read as T5's, whose
    layout gives other ids."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((family[1] / name).read_bytes())
    (folder / "spiece.model").write_bytes(b"")  # refused before it is read
    result = llmrun("run", str(folder), PROMPT)
    assert result.returncode != 0
    assert result.stderr == (
        f"error: {folder / 'spiece.model'} (PegasusTokenizer's) is not supported: a folder with "
        "tokenizer.json is\n"
    )


@pytest.mark.parametrize("family", ["blenderbot"], indirect=True)
def test_blenderbots_encoder_no_repeat_ngram_size_is_transformers(family, monkeypatch):
    """The Hub's Blenderbot generation_config.json asks for encoder_no_repeat_ngram_size:
    greedy and beam decoding give generate's ids with it, and sampling repeats no source
    n-gram (the rule itself against transformers': tests/test_text_to_text.py)."""
    _, _, ref, _, engine, ids = family
    prompt = engine.tokenizer.encode(PROMPT)
    generation = dict(engine.checkpoint.generation_config)

    def decode(size, beams, params=None):
        file = {**generation, "encoder_no_repeat_ngram_size": size}
        monkeypatch.setattr(engine.checkpoint, "generation_config", file)
        options = text_to_text.Options(num_beams=beams)
        params = params or SamplingParams(temperature=0.0)
        responses = engine.generate(prompt, params, 16, options=options)
        return [r.token for r in responses if r.token is not None]

    for size, beams in ((1, 1), (2, 1), (1, 3), (2, 3)):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]),
                do_sample=False,
                num_beams=beams,
                max_new_tokens=16,
                encoder_no_repeat_ngram_size=size,
            )[0]
        expected = out[1:].tolist()  # after decoder_start_token_id, up to </s>
        expected = expected[:-1] if expected[-1] == ref.config.eos_token_id else expected
        assert decode(size, beams) == expected, (size, beams)
    sampled = decode(1, 1, SamplingParams(temperature=1.5, seed=3))
    assert len(sampled) > 8 and not set(sampled) & set(ids)
    assert set(decode(0, 1, SamplingParams(temperature=1.5, seed=3))) & set(ids)


@pytest.mark.parametrize("family", ["mvp"], indirect=True)
def test_mvp_with_prompts_is_refused(family, tmp_path):
    """MVP's task-prompt checkpoints (use_prompt: prefix keys and values per layer) are one
    error line, not run as plain MVP."""
    folder = shutil.copytree(family[1], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["use_prompt"] = True
    (folder / "config.json").write_text(json.dumps(config))
    result = llmrun("run", str(folder), PROMPT, "-n", "2")
    assert result.returncode != 0
    assert result.stderr == "error: an MVP model with prompts (use_prompt) is not supported\n"
