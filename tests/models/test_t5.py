"""T5 text-to-text folders (llmrun.models.t5, llmrun.text_to_text) against transformers: a
tiny random flan-t5 (gated GELU, its own head), t5 v1.0 (ReLU, the head tied and outputs
scaled by d_model**-0.5) and UMT5 (a bias table per layer) give transformers' encoder output
and decoder logits (prefilled, then a token a step through the KV cache), and greedy
decoding gives transformers' generate ids; so do LongT5 (local and transient-global
encoder attention, a prompt of several blocks and a partial last one) and Switch
Transformers (experts whose capacity drops some of the prompt's tokens). The decoder's
relative positions read bidirectionally (the planted bug) fail, and so do LongT5's encoder
with its radius one short or without its global keys and Switch's without the capacity. `run` prints generate's text, `show` names the
model, and commands that need a chat template or the decoder-only loop refuse it in one
error line.

Tolerances: encoder output and logits 1e-4; ids and text exact.
"""

import json

import pytest
import torch
from in_process import llmrun
from t5_helpers import PROMPT, VARIANTS, reference, t5_folder, tokenizer_folder

from llmrun import api
from llmrun.models import t5 as t5_model
from llmrun.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tokenizer_folder(tmp_path_factory.mktemp("t5-tokenizer"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory, tokenizer):
    """(folder, transformers' model, llmrun's engine, the prompt's ids with </s>)."""
    folder = t5_folder(tmp_path_factory.mktemp(request.param), request.param, tokenizer)
    ref = reference(folder)
    engine = api.load(str(folder), text_to_text=True)
    ids = engine.tokenizer.encode(PROMPT) + [1]
    return folder, ref, engine, ids


def _logits(model, encoded, decoder_ids):
    """llmrun's decoder logits of decoder_ids [1, T]: 5 prefilled, then one a step."""
    decoding = model.decoding(encoded)
    cache = model.new_cache(1, 32, torch.float32, torch.device("cpu"))
    steps = [decoding(decoder_ids[:, :5], torch.arange(5)[None], cache)]
    for i in range(5, decoder_ids.shape[1]):
        steps.append(decoding(decoder_ids[:, i : i + 1], torch.tensor([[i]]), cache))
    return torch.cat(steps, dim=1)


def test_encoder_and_decoder_match_transformers(variant, monkeypatch):
    _, ref, engine, ids = variant
    prompt = torch.tensor([ids])
    assert len(ids) >= 40  # past relative_attention_max_distance: every kind of bucket
    decoder_ids = torch.tensor([[0, *range(20, 44)]])  # 25 positions, past it too
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=decoder_ids)
        encoded = engine.model.encode(prompt)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        logits = _logits(engine.model, encoded, decoder_ids)
        assert (logits - expected.logits).abs().max() < 1e-4
        # The planted bug: the decoder's relative positions bucketed bidirectionally.
        buckets = t5_model.relative_buckets
        monkeypatch.setattr(
            t5_model, "relative_buckets", lambda r, _, *rest: buckets(r, True, *rest)
        )
        wrong = _logits(engine.model, encoded, decoder_ids)
        assert (wrong - expected.logits).abs().max() > 1e-2


def _break_encoder(model, name: str, monkeypatch) -> None:
    """Plant the bug of variant `name`'s own encoder: LongT5's radius one
    short, its global keys left out; Switch Transformers' capacity ignored."""
    if name == "longt5-local":
        monkeypatch.setattr(model.args, "local_radius", 4)
    elif name == "longt5-tglobal":
        monkeypatch.setattr(model.args, "encoder_attention_type", "local")
    elif name == "switch":
        for block in model.encoder.block:
            if isinstance(getattr(block.layer[-1], "mlp", None), t5_model.SparseMLP):
                monkeypatch.setattr(block.layer[-1].mlp, "capacity", 10**6)


@pytest.mark.parametrize("variant", ["longt5-local", "longt5-tglobal", "switch"], indirect=True)
def test_encoders_of_longt5_and_switch_fail_their_planted_bugs(variant, request, monkeypatch):
    _, ref, engine, ids = variant
    _break_encoder(engine.model, request.node.callspec.params["variant"], monkeypatch)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        expected = ref.get_encoder()(input_ids=prompt).last_hidden_state
        assert (engine.model.encode(prompt) - expected).abs().max() > 1e-2


def test_greedy_decoding_is_transformers_generate(variant):
    _, ref, engine, ids = variant
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0]
    expected = expected[1:].tolist()  # without decoder_start_token_id
    responses = list(engine.generate(ids[:-1], SamplingParams(temperature=0.0), 16))
    tokens = [r.token for r in responses if r.token is not None]
    if responses[-1].finish_reason == "stop":
        tokens.append(1)  # generate keeps the </s> it stopped at
    assert tokens == expected
    assert len(tokens) >= 8
    assert responses[-1].stats.prompt_tokens == len(ids)  # the encoder's, with </s>


def test_run_prints_generates_text_and_show_names_it(variant, tokenizer):
    folder, ref, engine, ids = variant
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tokenizer).decode(expected[0], skip_special_tokens=True)
    result = llmrun("run", str(folder), PROMPT, "-n", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == text  # a pipe gets the text exactly
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    kind = json.loads((folder / "config.json").read_text())["model_type"]
    assert f"{kind} (text-to-text (encoder-decoder): 2 encoder and 2 decoder layers)" in (
        shown.stdout
    )


@pytest.mark.parametrize(
    "command",
    [["chat", "{folder}"], ["bench", "{folder}"], ["run", "{folder}", "hi", "--draft", "{folder}"]],
    ids=["chat", "bench", "draft"],
)
def test_what_t5_cannot_do_is_one_error_line(variant, command):
    result = llmrun(*(arg.format(folder=variant[0]) for arg in command))
    assert result.returncode != 0
    assert result.stderr.startswith("error: ")
    assert "text-to-text model (encoder-decoder)" in result.stderr
    assert result.stderr.count("\n") == 1
