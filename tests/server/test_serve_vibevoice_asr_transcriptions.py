"""serve's /v1/audio/transcriptions with a tiny random VibeVoice-ASR (vibevoice_asr_helpers): the
prompt ids are those of transformers' VibeVoiceAsrProcessor.apply_transcription_request (a
user turn of the clip and its duration, OpenAI's `prompt` as its extra info), and the reply
is transformers' greedy generation on them (sample=False; the context ends it, a random
model not stopping) read as decode(return_format="transcription_only") reads it, as json
and as text. A language, which its prompt has no place for, is one clear 400.

Tolerances: ids and text exact.
"""

import pytest
from transcription_serving import (
    CLIP,
    app_client,
    audio_service,
    check_transcription_is_transformers_s,
    transcribe,
)
from vibevoice_asr_helpers import processor, save_vibevoice_asr_dir, tiny_vibevoice_asr

from llmrun import audio, vibevoice_asr_clips

transformers = pytest.importorskip("transformers")
NAME = "vibevoice-asr"
# The prompt (the clip's 10 tokens, its duration and the instruction, which the tiny
# tokenizer spells in pieces: 167 tokens) and 20 of answer.
CONTEXT = 187


@pytest.fixture(scope="module")
def model():
    return tiny_vibevoice_asr(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_vibevoice_asr_dir(model, tmp_path_factory.mktemp("vibevoice_asr"))


@pytest.fixture(scope="module")
def service(folder):
    yield from audio_service(folder, NAME, CONTEXT)


@pytest.fixture(scope="module")
def client(service):
    yield from app_client(service)


def test_a_transcription_is_transformers_on_apply_transcription_request_s_ids(
    client, service, model, folder, monkeypatch
):
    samples = audio.open_audio(CLIP).at(24000)
    inputs = processor(folder).apply_transcription_request(samples, prompt="Ada met Bob.")
    # Read as the processor reads an answer (whose own reading
    # tests/models/test_vibevoice_asr.py checks).
    args = (model, inputs, NAME, CONTEXT, vibevoice_asr_clips.transcript, 10, dict(sample=False))
    answer = check_transcription_is_transformers_s(
        client, service, monkeypatch, *args, prompt="Ada met Bob."
    )
    assert answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"] == CONTEXT + 1
    plain = transcribe(client, NAME, prompt="Ada met Bob.", response_format="text")
    assert plain.text == answer["text"]


def test_a_language_is_one_400(client):
    response = transcribe(client, NAME, language="en")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "language 'en': VibeVoice-ASR's transcription prompt takes no language (it transcribes "
        "the language it hears): leave language out"
    )
