"""serve's /v1/audio/transcriptions and input_audio parts with a tiny random Audio Flamingo 3
(audioflamingo3_helpers): the prompt ids are those of transformers'
AudioFlamingo3Processor.apply_transcription_request (a user turn of "Transcribe the input
speech." and the clip), and the reply is transformers' greedy generation on them (the
context ends it, a random model not stopping) read as decode(strip_prefix=True) reads it.
A language is one clear 400. A chat request's input_audio part replies as run does.

Tolerances: ids and text exact.
"""

import pytest
from audioflamingo3_helpers import processor, save_audioflamingo3_dir, tiny_audioflamingo3
from transcription_serving import (
    CLIP,
    app_client,
    audio_service,
    check_an_input_audio_part_replies_as_run_does,
    check_refused,
    check_transcription_is_transformers_s,
)

from llmrun import audio, audioflamingo3_clips

transformers = pytest.importorskip("transformers")
NAME = "af3"
# The prompt (the clip's 32 tokens in a user turn after a system one, the instruction in
# the tiny tokenizer's pieces) and some 20 tokens of answer.
CONTEXT = 100


@pytest.fixture(scope="module")
def model():
    return tiny_audioflamingo3(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_audioflamingo3_dir(model, tmp_path_factory.mktemp("audioflamingo3"))


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
    transcript = audioflamingo3_clips.transcript
    args = (model, inputs, NAME, CONTEXT, transcript, 32)
    check_transcription_is_transformers_s(client, service, monkeypatch, *args)
    message = (
        "language 'en': Audio Flamingo 3's transcription prompt takes no language: leave "
        "language out"
    )
    check_refused(client, NAME, message, language="en")


def test_an_input_audio_part_replies_as_run_does(client, service):
    check_an_input_audio_part_replies_as_run_does(client, service)
