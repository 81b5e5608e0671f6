"""serve with audio for Voxtral, on a tiny random VoxtralForConditionalGeneration
(voxtral_helpers): chat's `input_audio` parts (base64 WAV). A greedy chat completion with
a clip equals `llmrun run --audio`'s tokens (the engine's single-sequence loop); a clip
sent again is encoded once; the prefix cache reuses a clip's blocks for the same clip
only (another clip of the same length at the same place gets its own reply); a format
other than WAV, bad base64, or audio for a model without an audio encoder is a 400;
`llmrun serve FOLDER` loads the audio tower.

Tolerances: tokens and text exact.
"""

import base64

import httpx
import pytest
from serving import GREEDY, Server
from starlette.testclient import TestClient
from voxtral_helpers import chirp, save_voxtral_dir, tiny_voxtral, wav_bytes

from llmrun import api
from llmrun.audio import open_audio
from llmrun.server import Service, create_app

pytest.importorskip("transformers")
QUESTION = "What do you hear?"
CLIP, OTHER_CLIP = wav_bytes(chirp(1.0, 16000, seed=1), 16000), wav_bytes(chirp(1.0, 8000, 2), 8000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_voxtral_dir(tiny_voxtral(), tmp_path_factory.mktemp("voxtral"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def service(engine):
    service = Service("voxtral", set(), None, parallel=2, queue=4)
    service.start(engine)
    yield service
    service.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as http:
        yield http


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt},
    }


def post(client, *content):
    body = {
        "messages": [{"role": "user", "content": list(content)}],
        "max_tokens": 8,
        "temperature": 0,
    }
    return client.post("/v1/chat/completions", json=body)


def reply(client, clip: bytes, text: str = QUESTION) -> dict:
    response = post(client, audio_part(clip), {"type": "text", "text": text})
    assert response.status_code == 200, response.text
    return response.json()


def alone(engine, clip: bytes, text: str = QUESTION) -> tuple[str, list[int]]:
    """`llmrun run --audio`'s greedy reply: the single-sequence loop."""
    prompt = engine.prompt_text(text, audio=1)
    ids, prompt_images = engine.audio_prompt(prompt, [open_audio(clip)])
    responses = list(engine.generate(ids, GREEDY, 8, images=prompt_images))
    return "".join(r.text for r in responses), [r.token for r in responses if r.token is not None]


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_greedy_reply_to_a_clip_is_run_s(client, engine, service):
    answer = reply(client, CLIP)
    text, tokens = alone(engine, CLIP)
    assert answer["choices"][0]["message"]["content"] == text
    # [BOS] [INST] [BEGIN_AUDIO], 375 [AUDIO], the question, [/INST]
    assert answer["usage"]["prompt_tokens"] == len(
        engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [open_audio(CLIP)])[0]
    )
    assert answer["usage"]["completion_tokens"] == len(tokens)
    again = reply(client, CLIP)
    assert again["choices"] == answer["choices"]
    assert cached(again) > 375  # the clip's blocks
    assert len(service.audio_encoder.kept) == 1


def test_the_prefix_cache_reuses_a_clip_only_for_the_same_clip(client, engine):
    reply(client, CLIP)
    answer = reply(client, OTHER_CLIP)  # the same ids: 375 [AUDIO] at the same place
    assert cached(answer) < 8
    assert answer["choices"][0]["message"]["content"] == alone(engine, OTHER_CLIP)[0]
    assert alone(engine, OTHER_CLIP) != alone(engine, CLIP)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (
            audio_part(CLIP, "mp3"),
            "messages.0.content.0.input_audio.format: audio of format 'mp3'; serve takes WAV",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}},
            "the base64 does not decode",
        ),
        (audio_part(b"fLaC" + bytes(64)), "FLAC audio; llmrun reads WAV"),
    ],
)
def test_bad_audio_is_a_400(client, part, message):
    response = post(client, part, {"type": "text", "text": QUESTION})
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_audio_for_a_model_without_an_audio_encoder_is_a_400(tmp_path):
    engine = api.load(None, device="cpu")
    service = Service("stories", set(), None, parallel=1, queue=2)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            response = post(http, audio_part(CLIP), {"type": "text", "text": "hi"})
    finally:
        service.close()
    assert response.status_code == 400
    assert "takes no audio" in response.json()["error"]["message"]


def test_llmrun_serve_loads_a_voxtral_folder_s_audio_tower(folder, engine, tmp_path):
    server = Server(tmp_path, str(folder))
    try:
        assert "takes audio" in server.log.read_text()
        props = httpx.get(f"{server.url}/props").json()
        body = {"messages": [{"role": "user", "content": [audio_part(CLIP)]}]}
        body.update(temperature=0, max_tokens=8)
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.stop()
    assert props["modalities"] == {"vision": False, "audio": True}
    assert answer["choices"][0]["message"]["content"] == alone(engine, CLIP, "")[0]
