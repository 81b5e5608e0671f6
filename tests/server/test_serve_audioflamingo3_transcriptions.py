"""serve's /v1/audio/transcriptions and input_audio parts with a tiny random Audio Flamingo 3
(audioflamingo3_helpers): the prompt ids are those of transformers'
AudioFlamingo3Processor.apply_transcription_request (a user turn of "Transcribe the input
speech." and the clip), and the reply is transformers' greedy generation on them (the
context ends it, a random model not stopping) read as decode(strip_prefix=True) reads it.
A language is one clear 400. A chat request's input_audio part replies as run does.

Tolerances: ids and text exact.
"""

import base64

import pytest
import torch
from audioflamingo3_helpers import processor, save_audioflamingo3_dir, tiny_audioflamingo3
from serving import GREEDY
from starlette.testclient import TestClient
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, audioflamingo3_clips
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")
CLIP = wav_bytes(chirp(1.3, 16000, seed=3), 16000)
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
    engine = api.load(str(folder), device="cpu", audio=True, ctx_size=CONTEXT)
    service = Service("af3", set(), None, parallel=1, queue=4)
    service.start(engine)
    yield service
    service.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as http:
        yield http


def transcribe(client, **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post("/v1/audio/transcriptions", data={"model": "af3", **fields}, files=files)


def test_a_transcription_is_transformers_on_apply_transcription_request_s_ids(
    client, service, model, folder, monkeypatch
):
    prompts = []
    submit = service.scheduler.submit

    def recorded(request, on_event):
        prompts.append(request.prompt)
        return submit(request, on_event)

    monkeypatch.setattr(service.scheduler, "submit", recorded)
    response = transcribe(client)
    assert response.status_code == 200, response.text
    inputs = processor(folder).apply_transcription_request(audio.open_audio(CLIP).samples)
    ids = inputs["input_ids"][0].tolist()
    assert prompts == [ids]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=CONTEXT + 1 - len(ids), do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    # llmrun's decode (whose byte tokens' text is not transformers' replacement
    # characters), read as decode(strip_prefix=True) reads it (which
    # tests/models/test_audioflamingo3.py checks).
    text = audioflamingo3_clips.transcript(service.engine.tokenizer.decode(tokens))
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["input_tokens"] == len(ids)
    assert answer["usage"]["input_token_details"]["audio_tokens"] == 32
    response = transcribe(client, language="en")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "language 'en': Audio Flamingo 3's transcription prompt takes no language: leave "
        "language out"
    )


def test_an_input_audio_part_replies_as_run_does(client, service):
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(CLIP).decode(), "format": "wav"},
    }
    content = [part, {"type": "text", "text": "Hi"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    engine = service.engine
    prompt = engine.prompt_text("Hi", audio=1)
    ids, clips = engine.audio_prompt(prompt, [audio.open_audio(CLIP)])
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=clips))
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
