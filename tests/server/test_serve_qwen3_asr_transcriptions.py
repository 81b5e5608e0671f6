"""serve's /v1/audio/transcriptions with a tiny random Qwen3-ASR (qwen3_asr_helpers): the
prompt ids are those of transformers' Qwen3ASRProcessor.apply_transcription_request, with
a language (its "language English<asr_text>" suffix), without (the model names the language
itself) and with a context (OpenAI's `prompt`, the processor's system turn), and the reply
is transformers' greedy generation on them (the context ends it, a random model not
stopping) read as Qwen3ASRProcessor.parse_output reads it, as json and as text. A language
Qwen3-ASR was not trained with is one clear 400. A chat request's input_audio part replies
as run does.

Tolerances: ids and text exact.
"""

import pytest
from qwen3_asr_helpers import processor, save_qwen3_asr_dir, tiny_qwen3_asr
from transcription_serving import (
    CLIP,
    app_client,
    audio_service,
    check_an_input_audio_part_replies_as_run_does,
    check_transcription_is_transformers_s,
    transcribe,
)

from llmrun import audio, qwen3_asr_clips

transformers = pytest.importorskip("transformers")
NAME = "qwen3-asr"
# The prompt (a user turn of the clip's 17 tokens, the assistant's turn begun; 50 tokens
# with a language, which the tiny tokenizer spells letter by letter) and some 20 tokens of
# answer.
CONTEXT = 72


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_asr(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qwen3_asr_dir(model, tmp_path_factory.mktemp("qwen3-asr"))


@pytest.fixture(scope="module")
def service(folder):
    yield from audio_service(folder, NAME, CONTEXT)


@pytest.fixture(scope="module")
def client(service):
    yield from app_client(service)


@pytest.mark.parametrize(("language", "context"), [("en", None), (None, None), ("de", "Ada")])
def test_a_transcription_is_transformers_on_apply_transcription_request_s_ids(
    client, service, model, folder, monkeypatch, language, context
):
    fields = {"language": language} if language else {}
    fields |= {"prompt": context} if context else {}
    made = processor(folder)
    samples = audio.open_audio(CLIP).samples
    inputs = made.apply_transcription_request(samples, language=language, prompt=context)
    # Read as parse_output reads it (whose own reading tests/models/test_qwen3_asr.py checks).
    args = (model, inputs, NAME, CONTEXT, qwen3_asr_clips.transcript, 17)
    answer = check_transcription_is_transformers_s(client, service, monkeypatch, *args, **fields)
    assert answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"] == CONTEXT + 1
    plain = transcribe(client, NAME, response_format="text", **fields)
    assert plain.text == answer["text"]


def test_a_language_it_was_not_trained_with_is_one_400(client):
    response = transcribe(client, NAME, language="sw")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "language 'sw': Qwen3-ASR transcribes ar, cs, da, de, el, en, es, fa, fi, fr, hi"
    )


def test_an_input_audio_part_replies_as_run_does(client, service):
    check_an_input_audio_part_replies_as_run_does(client, service)
