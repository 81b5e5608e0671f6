"""serve with a tiny random Cohere Transcribe (tests/cohere_asr_helpers.py):
/v1/audio/transcriptions answers transformers' CohereAsrForConditionalGeneration.generate
text (greedy, after CohereAsrProcessor's prompt for the request's language) for the
uploaded WAV, as json (with usage) and as text. A request without a language (the model
does not detect it), with a prompt, and a translation are one clear 400 each.

Tolerances: text exact.
"""

import pytest
from cohere_asr_helpers import tiny_cohere_asr_dir, transcript
from serving import served
from voxtral_helpers import chirp, wav_bytes

from llmrun import api

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(2.0, 16000, seed=3)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cohere_asr")
    return path, *tiny_cohere_asr_dir(path, seed=1)


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "cohere")


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "cohere", **fields}, files=files)


def test_a_transcription_is_transformers_generate(client, folder):
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    ids, text = transcript(*folder[1:], samples, "de")
    response = post(client, language="de")
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["output_tokens"] == len(ids)
    plain = post(client, language="de", response_format="text")
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == text


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("transcriptions", {}, "Cohere Transcribe does not detect the language: give it"),
        ("transcriptions", {"language": "en", "prompt": "hi"}, "Cohere Transcribe takes no"),
        ("translations", {}, "Cohere Transcribe transcribes; it does not translate"),
    ],
    ids=["no-language", "prompt", "translation"],
)
def test_what_it_cannot_do_is_one_400(client, endpoint, fields, message):
    response = post(client, endpoint, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
