"""serve's /v1/audio/transcriptions with a tiny random OmniASR (omniasr_helpers): the prompt
ids are those of transformers' OmniASRProcessor.apply_transcription_request with the
request's language, and the reply is transformers' greedy generation on them (the context
ends it, a random model not stopping), as json and as text. A language the model has no
token for, or a prompt, which OmniASR's transcription prompt has no place for, is one
clear 400. A chat request's input_audio part replies as run does.

Tolerances: ids and text exact.
"""

import pytest
from omniasr_helpers import processor, save_omniasr_dir, tiny_omniasr
from transcription_serving import (
    CLIP,
    app_client,
    audio_service,
    check_an_input_audio_part_replies_as_run_does,
    check_transcription_is_transformers_s,
    transcribe,
)

from llmrun import audio

transformers = pytest.importorskip("transformers")
NAME = "omniasr"
# The prompt (the 1.3-second clip's 65 tokens, the language and BOS) and some 20 tokens of
# answer.
CONTEXT = 87


@pytest.fixture(scope="module")
def model():
    return tiny_omniasr(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_omniasr_dir(model, tmp_path_factory.mktemp("omniasr"))


@pytest.fixture(scope="module")
def service(folder):
    yield from audio_service(folder, NAME, CONTEXT)


@pytest.fixture(scope="module")
def client(service):
    yield from app_client(service)


def test_a_transcription_is_transformers_on_apply_transcription_request_s_ids(
    client, service, model, folder, monkeypatch
):
    samples = audio.open_audio(CLIP).samples
    inputs = processor(folder).apply_transcription_request(
        samples, language="fr", return_tensors="pt"
    )
    args = (model, inputs, NAME, CONTEXT, str, 65)
    answer = check_transcription_is_transformers_s(
        client, service, monkeypatch, *args, language="fr"
    )
    assert answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"] == CONTEXT + 1
    plain = transcribe(client, NAME, language="fr", response_format="text")
    assert plain.text == answer["text"]


def test_an_unknown_language_or_a_prompt_is_one_400(client):
    response = transcribe(client, NAME, language="de")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "language 'de': the model has no <|lang:deu_latn|> token; give an ISO 639-1 code (en), "
        "one of its language codes (eng_Latn), or auto"
    )
    response = transcribe(client, NAME, prompt="Ada")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "prompt: OmniASR's transcription prompt has no place for a text"
    )


def test_an_input_audio_part_replies_as_run_does(client, service):
    check_an_input_audio_part_replies_as_run_does(client, service)
