"""serve with a tiny random Canary (tests/canary_helpers.py): /v1/audio/transcriptions
answers transformers' CanaryForConditionalGeneration.generate text (greedy, after the
processor's prompt for the request's language) for the uploaded WAV, as json (with usage)
and as text, and /v1/audio/translations its English translation of the clip in the
request's `language`. A request without a language (the model does not detect it) and one
with a prompt are one clear 400 each.

Tolerances: text exact.
"""

import pytest
from canary_helpers import tiny_canary_dir, transcript
from serving import served
from voxtral_helpers import chirp, wav_bytes

from llmrun import api

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(2.0, 16000, seed=3)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("canary")
    return path, *tiny_canary_dir(path, seed=2)


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "canary")


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "canary", **fields}, files=files)


@pytest.mark.parametrize(("endpoint", "target"), [("transcriptions", None), ("translations", "en")])
def test_a_transcription_and_a_translation_are_transformers_generate(
    client, folder, endpoint, target
):
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    ids, text = transcript(*folder[1:], samples, "de", target)
    response = post(client, endpoint, language="de")
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["output_tokens"] == len(ids)
    plain = post(client, endpoint, language="de", response_format="text")
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == text


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("transcriptions", {}, "Canary does not detect the language: give it"),
        ("translations", {}, "Canary does not detect the language: give it"),
        ("transcriptions", {"language": "en", "prompt": "hi"}, "Canary takes no prompt"),
    ],
    ids=["no-language", "translation-without-language", "prompt"],
)
def test_what_it_cannot_do_is_one_400(client, endpoint, fields, message):
    response = post(client, endpoint, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
