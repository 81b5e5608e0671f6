"""serve with a tiny random Voxtral Realtime (tests/voxtral_realtime_helpers.py):
/v1/audio/transcriptions answers transformers' VoxtralRealtimeForConditionalGeneration.generate
text (greedy, every audio token read) for the uploaded WAV, decoded as mistral_common
decodes it, as json (with usage) and as text. A language, a translation and beams are one
clear 400 each.

Tolerances: ids and text exact.
"""

import pytest
from serving import served
from voxtral_helpers import chirp, wav_bytes
from voxtral_realtime_helpers import (
    greedy,
    processor,
    save_voxtral_realtime_dir,
    tiny_voxtral_realtime,
)

from llmrun import api, audio

transformers = pytest.importorskip("transformers")
pytest.importorskip("mistral_common")
CLIP = wav_bytes(chirp(0.9, 16000, seed=3), 16000)


@pytest.fixture(scope="module")
def model():
    return tiny_voxtral_realtime(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_voxtral_realtime_dir(model, tmp_path_factory.mktemp("voxtral_realtime"))


@pytest.fixture(scope="module")
def client(folder):
    engine = api.load(str(folder), device="cpu", generate=False)
    yield from served(engine, "voxtral-realtime")


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    data = {"model": "voxtral-realtime", **fields}
    return client.post(f"/v1/audio/{endpoint}", data=data, files=files)


def test_a_transcription_is_transformers_generate(client, model, folder):
    made = processor(folder)
    ids = greedy(model, made(audio.open_audio(CLIP).samples, return_tensors="pt"))
    text = made.tokenizer.decode(ids, skip_special_tokens=True)
    response = post(client)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["output_tokens"] == len(ids)
    plain = post(client, response_format="text")
    assert plain.text == text


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("transcriptions", {"language": "en"}, "Voxtral Realtime takes no language"),
        ("translations", {}, "Voxtral Realtime transcribes; it does not translate"),
        (
            "transcriptions",
            {"num_beams": "2"},
            "num_beams: voxtral-realtime is a Voxtral Realtime model, which llmrun decodes "
            "without beams",
        ),
    ],
    ids=["language", "translation", "beams"],
)
def test_what_it_cannot_do_is_one_400(client, endpoint, fields, message):
    response = post(client, endpoint, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
