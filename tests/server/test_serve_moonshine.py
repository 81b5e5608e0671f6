"""serve with a tiny random Moonshine (tests/moonshine_helpers.py): /v1/audio/transcriptions
answers transformers' MoonshineForConditionalGeneration.generate text (greedy) for the
uploaded WAV, as json (with usage), as text and as verbose_json (without segments: Moonshine
predicts no times); a language (Moonshine takes none), a translation, srt and segment
timestamps are one clear 400 each.

Tolerances: text exact.
"""

import pytest
from moonshine_helpers import tiny_moonshine_dir
from serving import served
from voxtral_helpers import chirp, wav_bytes

from llmrun import api

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(2.0, 16000, seed=3)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("moonshine")
    return path, *tiny_moonshine_dir(path, seed=1)


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "moonshine")


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "moonshine", **fields}, files=files)


def test_a_transcription_is_transformers_generate(client, folder):
    path, hf, extractor = folder
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    inputs = extractor(samples, sampling_rate=16000, return_tensors="pt")
    out = hf.generate(**inputs)
    text = transformers.AutoTokenizer.from_pretrained(path).decode(out[0], skip_special_tokens=True)
    response = post(client)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["input_tokens"] == 1  # the decoder start
    plain = post(client, response_format="text")
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == text
    verbose = post(client, response_format="verbose_json").json()
    assert verbose == {"task": "transcribe", "language": None, "duration": 2.0, "text": text}


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("transcriptions", {"language": "en"}, "Moonshine takes no language"),
        ("translations", {}, "Moonshine transcribes; it does not translate"),
        (
            "transcriptions",
            {"response_format": "srt"},
            "response_format 'srt': moonshine predicts no timestamps (llmrun times speech "
            "with Whisper and Parakeet models)",
        ),
        (
            "transcriptions",
            {"response_format": "verbose_json", "timestamp_granularities[]": "segment"},
            "timestamp_granularities[] segment: moonshine predicts no timestamps",
        ),
    ],
    ids=["language", "translation", "srt", "segment"],
)
def test_what_it_cannot_do_is_one_400(client, endpoint, fields, message):
    response = post(client, endpoint, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
