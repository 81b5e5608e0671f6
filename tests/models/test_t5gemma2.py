"""T5Gemma 2 text-to-text folders (llmrun.models.t5gemma2, llmrun.text_to_text) against
transformers: a tiny random folder (tests/t5_helpers.py: Gemma 3 stacks with q/k norms,
grouped keys and values, sliding windows of 4, two RoPE bases, a SigLIP image encoder)
gives transformers' encoder output and decoder logits (prefilled, then a token a step
through the KV cache) for a prompt holding the end-of-image token, and greedy decoding
gives transformers' generate ids. The encoder's window mirrored (the planted bug:
transformers' looks 1 back and 2 ahead) fails. `run --raw` prints generate's text (the
image encoder left out, as a note says); `show` names the family. With an image, the prompt's ids
are Gemma3Processor's, the encoder's output transformers' for its pixel values, and `run
--image` prints generate's text, as serve's chat endpoint answers an image part.

Tolerances: encoder output and logits 1e-4; ids and text exact.
"""

import pytest
import serving
import torch
from in_process import llmrun
from t5_helpers import PROMPT, t5gemma2_folder
from vision_helpers import EOI, picture, processor_inputs

from llmrun import api
from llmrun.images import open_image
from llmrun.models import t5gemma2
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder, transformers' model, llmrun's engine)."""
    folder = t5gemma2_folder(tmp_path_factory.mktemp("t5gemma2"))
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    return folder, ref, api.load(str(folder), text_to_text=True)


def _logits(model, encoded, decoder_ids):
    """llmrun's decoder logits of decoder_ids [1, T]: 5 prefilled, then one a step."""
    decoding = model.decoding(encoded)
    cache = model.new_cache(1, 32, torch.float32, torch.device("cpu"))
    steps = [decoding(decoder_ids[:, :5], torch.arange(5)[None], cache)]
    for i in range(5, decoder_ids.shape[1]):
        steps.append(decoding(decoder_ids[:, i : i + 1], torch.tensor([[i]]), cache))
    return torch.cat(steps, dim=1)


def test_encoder_and_decoder_match_transformers(model, monkeypatch):
    _, ref, engine = model
    ids = engine.tokenizer.encode_sequence(PROMPT)
    ids[10] = EOI
    prompt = torch.tensor([ids])
    decoder_ids = torch.tensor([[1, *range(20, 40), EOI, 44, 45, 46]])  # past the window
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=decoder_ids)
        encoded = engine.model.encode(prompt)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        logits = _logits(engine.model, encoded, decoder_ids)
        assert (logits - expected.logits).abs().max() < 1e-4
        window = t5gemma2.encoder_window
        monkeypatch.setattr(t5gemma2, "encoder_window", lambda *a: window(*a).transpose(2, 3))
        wrong = engine.model.encode(prompt)
        assert (wrong - expected.encoder_last_hidden_state).abs().max() > 1e-2


def test_greedy_decoding_is_transformers_generate(model):
    _, ref, engine = model
    ids = engine.tokenizer.encode_sequence(PROMPT)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0]
    responses = list(engine.generate(ids, SamplingParams(temperature=0.0), 16))
    tokens = [r.token for r in responses if r.token is not None]
    assert tokens == expected[1:].tolist()  # generate's without its start token
    assert len(set(tokens)) >= 8


def test_run_prints_generates_text_and_show_names_it(model):
    folder, ref, engine = model
    ids = engine.tokenizer.encode_sequence(PROMPT)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)
    result = llmrun("run", folder, PROMPT, "--raw", "-n", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == engine.tokenizer.decode(out[0, 1:].tolist())
    assert "a multimodal T5Gemma 2; running its text, without the vision tower" in result.stderr
    shown = llmrun("show", folder)
    assert shown.returncode == 0, shown.stderr
    assert "t5gemma2 (text-to-text (encoder-decoder): 2 encoder and 2 decoder layers)" in (
        shown.stdout
    )


def test_an_image_goes_into_the_encoder_as_transformers_puts_it(model, tmp_path):
    folder, ref, engine = model
    question = "What is in this picture?"
    image = picture(48, 80, 1)
    inputs = processor_inputs(folder, [open_image(image)], question)
    text = engine.prompt_text(question, images=1)
    ids, images = engine.media_prompt(text, [open_image(image)], [])
    assert ids == inputs.input_ids[0].tolist()
    with torch.no_grad():
        expected = ref.get_encoder()(
            input_ids=inputs.input_ids, pixel_values=inputs.pixel_values
        ).last_hidden_state
        encoded = engine.model.encode(torch.tensor([ids]), images)
        assert (encoded - expected).abs().max() < 1e-4
        out = ref.generate(
            input_ids=inputs.input_ids,
            pixel_values=inputs.pixel_values,
            do_sample=False,
            max_new_tokens=8,
        )
    (tmp_path / "picture.png").write_bytes(image)
    result = llmrun(
        "run", folder, question, "--image", tmp_path / "picture.png", "-n", "8",
        "--temperature", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == engine.tokenizer.decode(out[0, 1:].tolist())
    assert "without the vision tower" not in result.stderr
    served = serving.served(engine, "t5gemma2")
    reply = serving.chat_reply(next(served), image, question, max_tokens=8)
    served.close()
    assert reply["choices"][0]["message"]["content"] == result.stdout
    assert reply["usage"]["prompt_tokens"] == len(ids)
