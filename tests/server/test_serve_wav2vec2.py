"""serve with a tiny random wav2vec 2.0 CTC model (tests/wav2vec2_helpers.py):
/v1/audio/transcriptions answers transformers' Wav2Vec2ForCTC argmax decode (the processor's
batch_decode) for the uploaded WAV, as json (with usage) and as text; a language is one
clear 400.

Tolerances: text exact.
"""

import pytest
from serving import served
from voxtral_helpers import chirp, wav_bytes
from wav2vec2_helpers import tiny_wav2vec2_dir, transcript

from llmrun import api

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(2.0, 16000, seed=3)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("wav2vec2")
    return path, *tiny_wav2vec2_dir(path, "base", seed=1)


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "w2v")


def post(client, **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post("/v1/audio/transcriptions", data={"model": "w2v", **fields}, files=files)


def test_a_transcription_is_transformers_decode(client, folder):
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    ids, text = transcript(*folder[1:], samples)
    response = post(client)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == text
    assert response.json()["usage"]["output_tokens"] == len(ids)
    plain = post(client, response_format="text")
    assert plain.text == text


def test_a_language_is_one_400(client):
    response = post(client, language="en")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("wav2vec2 takes no language")
