"""serve with a tiny random SeamlessM4T v2 (tests/seamless_m4t_helpers.py): a transcription
(`language` the model's code of the language spoken, which it writes, or its ISO 639-1 code),
a translation (into English) and a completion (source_language, target_language) answer
transformers' SeamlessM4Tv2Model.generate text; a transcription without a language, or with
one the folder lacks, is one clear 400.

Tolerances: text exact.
"""

import pytest
from seamless_m4t_helpers import masks_applied, seamless_folder
from serving import served
from voxtral_helpers import chirp, wav_bytes

from llmrun import api

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(0.51, 16000, seed=3)  # 49 frames: the last stacked one half padding
CLIP = wav_bytes(SAMPLES, 16000)
TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("seamless")
    hf, processor = seamless_folder(path)
    with masks_applied():
        yield path, hf, processor


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "seamless")


def generated(folder, target: str, **inputs) -> str:
    _, hf, processor = folder
    out = hf.generate(**processor(**inputs, return_tensors="pt"), tgt_lang=target,
                      generate_speech=False)  # fmt: skip
    return processor.decode(out.sequences[0], skip_special_tokens=True)


def post(client, endpoint: str, **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "seamless", **fields}, files=files)


def test_speech_and_text_answer_as_generate(client, folder):
    samples = ((SAMPLES * 32767).round() / 32768).astype("float32")  # as serve decodes it
    speech = {"audio": samples, "sampling_rate": 16000}
    expected = generated(folder, "fra", **speech)
    for language in ("fra", "fr"):  # the model's code, or the ISO 639-1 one OpenAI's take
        answer = post(client, "transcriptions", language=language, response_format="text")
        assert (answer.status_code, answer.text) == (200, expected)
    answer = post(client, "translations")
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == generated(folder, "eng", **speech)
    body = {"model": "seamless", "prompt": TEXT, "max_tokens": 12}
    languages = {"source_language": "deu", "target_language": "fra"}
    answer = client.post("/v1/completions", json={**body, **languages})
    assert answer.status_code == 200, answer.text
    expected = generated(folder, "fra", text=TEXT, src_lang="deu")
    assert answer.json()["choices"][0]["text"] == expected


def test_a_transcription_without_a_language_or_with_an_unknown_one_is_one_400(client):
    response = post(client, "transcriptions")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("SeamlessM4T writes the language")
    response = post(client, "transcriptions", language="es")  # spa: not the folder's
    assert response.status_code == 400
    assert "unknown target language 'es'" in response.json()["error"]["message"]
