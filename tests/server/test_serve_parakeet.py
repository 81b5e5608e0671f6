"""serve with a tiny random Parakeet TDT (tests/parakeet_helpers.py):
/v1/audio/transcriptions answers transformers' ParakeetForTDT.generate text (greedy, through
the processor's batch_decode) for the uploaded WAV, as json (with usage), as text, as
verbose_json with its segments and, asked for by timestamp_granularities[], its words (the
first starting at the processor's first token time), and as srt and vtt; a language, a
translation and a chat completion are one clear 400 each.

Tolerances: text and times exact.
"""

import pytest
from parakeet_helpers import tiny_parakeet_dir, token_times, transcript
from serving import served
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio
from llmrun import transcript_formats as formats

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(3.0, 16000, seed=1)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("parakeet")
    return path, *tiny_parakeet_dir(path, "tdt", seed=1)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", generate=False)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "parakeet")


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "parakeet", **fields}, files=files)


def test_a_transcription_is_transformers_generate(client, folder):
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    ids, text = transcript(*folder[1:], samples)
    response = post(client)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == text
    assert (answer["usage"]["input_tokens"], answer["usage"]["output_tokens"]) == (0, len(ids))
    plain = post(client, response_format="text")
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == text


def test_segments_words_and_subtitles(client, folder, engine):
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    first = token_times(*folder[1:], samples)[0][0]
    timed = engine.transcribe(audio.open_audio(CLIP), timestamps=True, words=True)
    verbose = post(client, response_format="verbose_json").json()
    segments = formats.verbose_json(timed.text, None, "transcribe", 3.0, timed.segments)
    assert verbose == segments
    assert verbose["segments"][0]["start"] == first
    both = ["segment", "word"]
    for granularities, keys in ((["word"], {"words"}), (both, {"words", "segments"})):
        fields = {"response_format": "verbose_json", "timestamp_granularities[]": granularities}
        answer = post(client, **fields).json()
        assert keys <= answer.keys() and not ({"words", "segments"} - keys) & answer.keys()
        assert answer["words"][0]["start"] == first
        assert answer["words"] == [
            {"word": w.word.strip(), "start": w.start, "end": w.end} for w in timed.words
        ]
    srt = post(client, response_format="srt")
    assert srt.headers["content-type"].startswith("application/x-subrip")
    assert srt.text == formats.srt(timed.segments) and srt.text.startswith("1\n00:00:")
    assert post(client, response_format="vtt").text == formats.vtt(timed.segments)


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("transcriptions", {"language": "en"}, "Parakeet takes no language"),
        ("translations", {}, "Parakeet transcribes; it does not translate"),
    ],
    ids=["language", "translation"],
)
def test_what_it_cannot_do_is_one_400(client, endpoint, fields, message):
    response = post(client, endpoint, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)


def test_a_chat_completion_is_one_400(client):
    body = {"model": "parakeet", "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "parakeet is a speech recognition model (Parakeet); use /v1/audio/transcriptions"
    )
