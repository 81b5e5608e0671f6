"""serve with a tiny random Speech2Text (tests/speech_to_text_helpers.py):
/v1/audio/transcriptions answers transformers' Speech2TextForConditionalGeneration.generate
text (greedy) for the uploaded WAV, as json (with usage) and as text. A language and a
translation are one clear 400 each.

Tolerances: text exact.
"""

import pytest
from serving import served
from speech_to_text_helpers import tiny_speech_to_text_dir, transcript
from voxtral_helpers import chirp, wav_bytes

from llmrun import api

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(2.0, 16000, seed=3)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech_to_text")
    return path, *tiny_speech_to_text_dir(path, seed=2)


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "s2t")


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "s2t", **fields}, files=files)


def test_a_transcription_is_transformers_generate(client, folder):
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    ids, text = transcript(*folder[1:], samples)
    response = post(client)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["output_tokens"] == len(ids)
    plain = post(client, response_format="text")
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == text


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("transcriptions", {"language": "en"}, "Speech2Text takes no language"),
        ("translations", {}, "Speech2Text transcribes; it does not translate"),
    ],
    ids=["language", "translation"],
)
def test_what_it_cannot_do_is_one_400(client, endpoint, fields, message):
    response = post(client, endpoint, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
