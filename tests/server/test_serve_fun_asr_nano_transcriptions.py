"""serve's /v1/audio/transcriptions with a tiny random Fun-ASR-Nano (fun_asr_nano_helpers): the
prompt ids are those of transformers' FunAsrNanoProcessor.apply_transcription_request (a
user turn of the clip, OpenAI's `prompt` as its context text, the language's name in its
instruction), and the reply is transformers' greedy generation on them (the context ends
it, a random model not stopping), as json and as text. A language the instruction has no
name for is one clear 400. A chat request's input_audio part replies as run does.

Tolerances: ids and text exact.
"""

import pytest
from fun_asr_nano_helpers import processor, save_fun_asr_nano_dir, tiny_fun_asr_nano
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
NAME = "fun-asr-nano"
# The prompt (the clip's 22 tokens in a user turn with the context and the Chinese
# instruction, which the tiny tokenizer spells in bytes: 242 tokens) and 20 of answer.
CONTEXT = 262


@pytest.fixture(scope="module")
def model():
    return tiny_fun_asr_nano(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_fun_asr_nano_dir(model, tmp_path_factory.mktemp("fun_asr_nano"))


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
    made = processor(folder)
    inputs = made.apply_transcription_request(samples, language="en", prompt="Ada met Bob.")
    args = (model, inputs, NAME, CONTEXT, str, 22)
    fields = dict(language="en", prompt="Ada met Bob.")
    answer = check_transcription_is_transformers_s(client, service, monkeypatch, *args, **fields)
    assert answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"] == CONTEXT + 1
    plain = transcribe(client, NAME, **fields, response_format="text")
    assert plain.text == answer["text"]


def test_a_language_without_a_name_in_the_instruction_is_one_400(client):
    response = transcribe(client, NAME, language="fr")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "language 'fr': Fun-ASR-Nano's transcription prompt names zh, en or ja (leave language "
        "out for another: it transcribes the language it hears)"
    )


def test_an_input_audio_part_replies_as_run_does(client, service):
    check_an_input_audio_part_replies_as_run_does(client, service)
