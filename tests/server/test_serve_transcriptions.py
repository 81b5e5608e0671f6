"""serve's /v1/audio/transcriptions with a tiny random Voxtral whose folder holds a
tekken.json as Voxtral's (voxtral_helpers.write_voxtral_tekken): the prompt ids are those
of transformers' VoxtralProcessor.apply_transcription_request (mistral_common's
TranscriptionRequest), with and without a language, and the reply is transformers' greedy
generation on them, decoded (the context ends it, a random model not stopping: its last
position's token is the last), as json, as text and as verbose_json (without segments:
Voxtral predicts no times). A bad file, a missing file field, an unknown response format,
srt (no times), a bad language, a file over serve's audio limit, a model without
an audio encoder and an audio model whose family documents no transcription prompt are
one clear 400 each (a body over the limit a 413); a transcription and a chat request in
flight together are decoded together and both complete as each does alone, and /metrics
counts the transcriptions.

Tolerances: ids and text exact.
"""

import threading
import time

import pytest
import torch
from qwen2_audio_helpers import save_qwen2_audio_dir, tiny_qwen2_audio
from starlette.testclient import TestClient
from voxtral_helpers import (
    TEKKEN_AUDIO,
    TEKKEN_VOCAB,
    chirp,
    tiny_voxtral,
    wav_bytes,
    write_voxtral_tekken,
)

from llmrun import api, audio_families
from llmrun.server import Service, create_app
from llmrun.server.audio import MAX_AUDIO_BYTES

transformers = pytest.importorskip("transformers")
pytest.importorskip("mistral_common")
pytest.importorskip("soundfile")  # apply_transcription_request reads the file with it
pytest.importorskip("soxr")
CLIP = wav_bytes(chirp(1.0, 16000, seed=1), 16000)
# One 30-second chunk: [BOS] [INST] [BEGIN_AUDIO], 375 [AUDIO], [/INST] (lang:en), [TRANSCRIBE].
CONTEXT = 400


@pytest.fixture(scope="module")
def model():
    return tiny_voxtral(audio_layers=1, vocab_size=TEKKEN_VOCAB, audio_token=TEKKEN_AUDIO)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("voxtral")
    model.save_pretrained(path)
    (path / "clip.wav").write_bytes(CLIP)
    return write_voxtral_tekken(path)


@pytest.fixture(scope="module")
def service(folder):
    engine = api.load(str(folder), device="cpu", audio=True, ctx_size=CONTEXT)
    service = Service("voxtral", set(), None, parallel=2, queue=4)
    service.start(engine)
    yield service
    service.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as http:
        yield http


@pytest.fixture(scope="module")
def processor(folder):
    tokenizer = transformers.MistralCommonBackend(tokenizer_path=str(folder / "tekken.json"))
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    return transformers.VoxtralProcessor(feature_extractor=extractor, tokenizer=tokenizer)


def reference(model, processor, folder, language):
    """apply_transcription_request's ids, and transformers' greedy text on them up to the
    end of the context (the token its last position gives is the last)."""
    inputs = processor.apply_transcription_request(
        audio=str(folder / "clip.wav"), language=language, model_id="voxtral", return_tensors="pt"
    )
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=CONTEXT + 1 - len(ids), do_sample=False)
    text = processor.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    return ids, text


def transcribe(client, clip: bytes = CLIP, **fields):
    files = {"file": ("clip.wav", clip, "audio/wav")} if clip is not None else None
    return client.post("/v1/audio/transcriptions", data={"model": "voxtral", **fields}, files=files)


@pytest.mark.parametrize("language", ["en", None])
def test_a_transcription_is_transformers_on_apply_transcription_request_s_ids(
    client, service, model, processor, folder, monkeypatch, language
):
    prompts = []
    submit = service.scheduler.submit

    def recorded(request, on_event):
        prompts.append(request.prompt)
        return submit(request, on_event)

    monkeypatch.setattr(service.scheduler, "submit", recorded)
    fields = {"language": language} if language else {}
    response = transcribe(client, **fields)
    assert response.status_code == 200, response.text
    ids, text = reference(model, processor, folder, language)
    assert prompts == [ids]
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["input_tokens"] == len(ids)
    assert answer["usage"]["input_token_details"]["audio_tokens"] == 375
    assert answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"] == CONTEXT + 1
    plain = transcribe(client, response_format="text", **fields)
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == text
    if language:  # verbose_json: no segments (Voxtral predicts no times)
        verbose = transcribe(client, response_format="verbose_json", **fields).json()
        assert verbose == {
            "task": "transcribe",
            "language": "english",
            "duration": 1.0,
            "text": text,
        }


@pytest.mark.parametrize(
    ("clip", "fields", "message"),
    [
        (b"fLaC" + bytes(64), {}, "file: FLAC audio; llmrun reads WAV"),
        (None, {}, "file: the audio is missing: send it as the form's file field"),
        (
            CLIP,
            {"response_format": "srt"},
            "response_format 'srt': voxtral predicts no timestamps (llmrun times speech with "
            "Whisper and Parakeet models)",
        ),
        (CLIP, {"response_format": "tsv"}, "response_format 'tsv': llmrun answers json, text"),
        (CLIP, {"language": "english"}, "language 'english': give an ISO 639-1 code"),
        (
            CLIP,
            {"num_beams": "2"},
            "num_beams: voxtral is a Voxtral model (an audio-language model), which llmrun "
            "transcribes without beams",
        ),
    ],
)
def test_a_bad_request_is_one_400(client, clip, fields, message):
    response = transcribe(client, clip, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)


def test_the_upload_is_bounded_by_serve_s_audio_limit(client):
    over = transcribe(client, bytes(MAX_AUDIO_BYTES + 1))
    assert over.status_code == 400
    assert over.json()["error"]["message"] == "file: audio over 25 MiB"
    body = transcribe(client, bytes(MAX_AUDIO_BYTES + (1 << 20)))
    assert body.status_code == 413


def test_a_model_without_an_audio_encoder_is_a_400():
    service = Service("stories", set(), None, parallel=1, queue=2)
    service.start(api.load(None, device="cpu"))
    try:
        with TestClient(create_app(service)) as http:
            response = http.post(
                "/v1/audio/transcriptions", files={"file": ("clip.wav", CLIP, "audio/wav")}
            )
    finally:
        service.close()
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "file: stories takes no audio: a GGUF's audio encoder is its mmproj file; for "
        f"{audio_families.NAMES} models, start serve with --mmproj FILE (llama.cpp's "
        "mmproj GGUF of the model)"
    )


def test_a_transcription_and_a_chat_in_flight_together_both_complete(client, service, monkeypatch):
    """The scheduler's steps wait for both requests, so that it decodes them together."""
    chat = {
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    alone = transcribe(client).json()["text"], client.post("/v1/chat/completions", json=chat)
    scheduler, submitted, together = service.scheduler, [], []
    submit, step = scheduler.submit, scheduler._step

    def counted(request, on_event):
        submitted.append(request)
        return submit(request, on_event)

    def held():
        deadline = time.monotonic() + 30
        while len(submitted) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        together.append(len(scheduler.active))
        step()

    monkeypatch.setattr(scheduler, "submit", counted)
    monkeypatch.setattr(scheduler, "_step", held)
    results = {}
    threads = [
        threading.Thread(target=lambda: results.update(text=transcribe(client))),
        threading.Thread(
            target=lambda: results.update(chat=client.post("/v1/chat/completions", json=chat))
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(together) == 2
    assert results["text"].json()["text"] == alone[0]
    assert results["chat"].json()["choices"] == alone[1].json()["choices"]
    metrics = client.get("/metrics").text
    assert 'llmrun_requests_total{endpoint="transcriptions",status="200"}' in metrics


def test_an_audio_model_without_a_documented_transcription_prompt_is_a_400(tmp_path):
    folder = save_qwen2_audio_dir(tiny_qwen2_audio(audio_layers=1), tmp_path)
    service = Service("qwen2-audio", set(), None, parallel=1, queue=2)
    service.start(api.load(str(folder), device="cpu", audio=True))
    try:
        with TestClient(create_app(service)) as http:
            response = http.post(
                "/v1/audio/transcriptions", files={"file": ("clip.wav", CLIP, "audio/wav")}
            )
    finally:
        service.close()
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "qwen2-audio is a Qwen2-Audio model, whose transcription prompt llmrun does not know "
        "(it transcribes with Voxtral, Qwen3-ASR, Granite Speech Plus, GLM-ASR, Fun-ASR-Nano, "
        "VibeVoice-ASR, Audio Flamingo 3, Phi-4-multimodal, OmniASR models); send the audio to "
        "/v1/chat/completions as an input_audio part with your instruction"
    )
