"""serve with a tiny random Whisper (tests/whisper_helpers.py): /v1/audio/transcriptions
answers transformers' WhisperForConditionalGeneration.generate text (greedy) for the
uploaded WAV, with the language detected or given and OpenAI's `prompt` as Whisper's
prompt_ids, as json (with usage) and as text; /v1/audio/translations answers generate's
task="translate". Chat completions (OpenAI's and ollama's) on a Whisper model, a temperature
above 0, a language on a translation and a translation by a model that is not Whisper are one
clear 400 each.

Tolerances: text exact.
"""

import pytest
from serving import served
from voxtral_helpers import chirp, wav_bytes
from whisper_helpers import tiny_whisper_dir

from llmrun import api

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(2.0, 16000, seed=3)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    return path, tiny_whisper_dir(path, seed=1)


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "whisper")


def expected_text(folder, **kwargs) -> str:
    """transformers' greedy transcript of CLIP as serve decodes it (16-bit WAV)."""
    path, hf = folder
    samples = (SAMPLES * 32767).round() / 32768
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    features = extractor(samples, sampling_rate=16000, return_tensors="pt").input_features
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if "prompt" in kwargs:
        kwargs["prompt_ids"] = tokenizer.get_prompt_ids(kwargs.pop("prompt"), return_tensors="pt")
    return tokenizer.batch_decode(hf.generate(features, **kwargs), skip_special_tokens=True)[0]


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "whisper", **fields}, files=files)


@pytest.mark.parametrize(
    "fields", [{}, {"language": "de", "prompt": "the quick fox"}], ids=["detected", "prompted"]
)
def test_a_transcription_is_transformers_generate(client, folder, fields):
    response = post(client, **fields)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == expected_text(folder, **fields)
    assert answer["usage"]["output_tokens"] > 0
    plain = post(client, response_format="text", **fields)
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == answer["text"]


def test_a_translation_is_transformers_generate_s_translate(client, folder):
    response = post(client, "translations")
    assert response.status_code == 200, response.text
    assert response.json()["text"] == expected_text(folder, task="translate")


def test_chat_and_bad_requests_are_one_400(client):
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "whisper", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400
    assert chat.json()["error"]["message"] == (
        "whisper is a speech recognition model (Whisper); use /v1/audio/transcriptions"
    )
    ollama = client.post(
        "/api/chat", json={"model": "whisper", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert ollama.status_code == 400
    assert "a speech recognition model (Whisper)" in ollama.json()["error"]
    hot = post(client, temperature="0.5")
    assert hot.status_code == 400
    assert hot.json()["error"]["message"].startswith("temperature: llmrun decodes Whisper greedily")
    language = post(client, "translations", language="de")
    assert language.status_code == 400
    assert language.json()["error"]["message"] == "language: a translation is into English"


def test_a_translation_by_a_model_that_is_not_whisper_is_a_400():
    for http in served(api.load(None, device="cpu"), "stories"):
        response = http.post(
            "/v1/audio/translations",
            data={"model": "stories"},
            files={"file": ("clip.wav", CLIP, "audio/wav")},
        )
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("stories is not a Whisper model")
