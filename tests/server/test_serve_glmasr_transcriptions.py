"""serve's /v1/audio/transcriptions with a tiny random GLM-ASR (glmasr_helpers): the prompt
ids are those of transformers' GlmAsrProcessor.apply_transcription_request (a user turn of
the clip and "Please transcribe this audio into text"), and the reply is transformers'
greedy generation on them (the context ends it, a random model not stopping) read as
GlmAsrProcessor.decode(strip_prefix=True) reads it, as json and as text. A language or a
prompt, which GLM-ASR's transcription prompt has no place for, is one clear 400. A chat
request's input_audio part replies as run does.

Tolerances: ids and text exact.
"""

import pytest
from glmasr_helpers import processor, save_glmasr_dir, tiny_glmasr
from transcription_serving import (
    CLIP,
    app_client,
    audio_service,
    check_an_input_audio_part_replies_as_run_does,
    check_refused,
    check_transcription_is_transformers_s,
    transcribe,
)

from llmrun import audio, glmasr_clips

transformers = pytest.importorskip("transformers")
NAME = "glm-asr"
# The prompt (the clip's 16 tokens in a user turn with the instruction, which the tiny
# tokenizer spells in pieces: 50 tokens) and some 20 tokens of answer.
CONTEXT = 70


@pytest.fixture(scope="module")
def model():
    return tiny_glmasr(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glmasr_dir(model, tmp_path_factory.mktemp("glmasr"))


@pytest.fixture(scope="module")
def service(folder):
    yield from audio_service(folder, NAME, CONTEXT)


@pytest.fixture(scope="module")
def client(service):
    yield from app_client(service)


def test_a_transcription_is_transformers_on_apply_transcription_request_s_ids(
    client, service, model, folder, monkeypatch
):
    inputs = processor(folder).apply_transcription_request(audio.open_audio(CLIP).samples)
    args = (model, inputs, NAME, CONTEXT, glmasr_clips.transcript, 16)
    answer = check_transcription_is_transformers_s(client, service, monkeypatch, *args)
    assert answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"] == CONTEXT + 1
    plain = transcribe(client, NAME, response_format="text")
    assert plain.text == answer["text"]


def test_a_language_or_a_prompt_is_one_400(client):
    language = (
        "language 'en': GLM-ASR's transcription prompt takes no language (it transcribes the "
        "language it hears): leave language out"
    )
    check_refused(client, NAME, language, language="en")
    prompt = "prompt: GLM-ASR's transcription prompt has no place for a text"
    check_refused(client, NAME, prompt, prompt="Ada")


def test_an_input_audio_part_replies_as_run_does(client, service):
    check_an_input_audio_part_replies_as_run_does(client, service)
