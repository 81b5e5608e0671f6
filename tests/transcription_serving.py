"""serve's /v1/audio/transcriptions and input_audio parts over a tiny audio model's folder,
for the tests that hold serve's replies to transformers' apply_transcription_request and
generate: the started Service and its client, a transcription request, the prompt ids serve
submits, transformers' greedy answer, the checks of a transcription against them and of a
refused one, and the chat check that an input_audio part replies as `llmrun run` does."""

from collections.abc import Iterator
from pathlib import Path

import torch
from audio_checks import audio_body
from serving import GREEDY
from starlette.testclient import TestClient
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio
from llmrun.server import Service, create_app

CLIP = wav_bytes(chirp(1.3, 16000, seed=3), 16000)


def audio_service(folder: Path, name: str, context: int) -> Iterator[Service]:
    """A started Service named `name` of the folder loaded with its audio and a context of
    `context` (one request at a time, 4 queued), closed after; a module fixture yields
    from it."""
    engine = api.load(str(folder), device="cpu", audio=True, ctx_size=context)
    service = Service(name, set(), None, parallel=1, queue=4)
    service.start(engine)
    try:
        yield service
    finally:
        service.close()


def app_client(service: Service) -> Iterator[TestClient]:
    """A TestClient on serve's app over `service`; a module fixture yields from it."""
    with TestClient(create_app(service)) as http:
        yield http


def transcribe(client: TestClient, name: str, **fields):
    """serve's response to a transcription of CLIP by model `name` with these form fields."""
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post("/v1/audio/transcriptions", data={"model": name, **fields}, files=files)


def submitted_prompts(service: Service, monkeypatch) -> list[list[int]]:
    """The prompt ids of each request serve submits to the service's scheduler from now on
    (the list fills as they come)."""
    prompts = []
    submit = service.scheduler.submit

    def recorded(request, on_event):
        prompts.append(request.prompt)
        return submit(request, on_event)

    monkeypatch.setattr(service.scheduler, "submit", recorded)
    return prompts


def greedy_answer(model, inputs, context: int, **options) -> list[int]:
    """transformers' greedy tokens after the prompt of `inputs` until prompt and answer fill
    a context of `context` and one more (where serve's reply ends, a random model not
    stopping); `options`: the model's generate's own."""
    prompt = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **inputs, **options, max_new_tokens=context + 1 - prompt, do_sample=False
        )
    return out[0, prompt:].tolist()


def check_transcription_is_transformers_s(
    client: TestClient,
    service: Service,
    monkeypatch,
    model,
    inputs,
    name: str,
    context: int,
    transcript,
    audio_tokens: int,
    generate_options: dict | None = None,
    **fields,
) -> dict:
    """serve's transcription of CLIP by model `name` with these form `fields` submits the
    ids of `inputs` (transformers' processor's apply_transcription_request of it), and its
    text is transformers' greedy answer after them up to the `context` (greedy_answer, with
    the model's `generate_options`) as the family's `transcript` reads llmrun's decode of it
    (whose byte tokens' text is not transformers' replacement characters; the model tests
    check `transcript` against decode(strip_prefix=True)); its usage counts the prompt and
    its `audio_tokens`. Returns the answer."""
    prompts = submitted_prompts(service, monkeypatch)
    response = transcribe(client, name, **fields)
    assert response.status_code == 200, response.text
    ids = inputs["input_ids"][0].tolist()
    assert prompts == [ids]
    tokens = greedy_answer(model, inputs, context, **(generate_options or {}))
    answer = response.json()
    assert answer["text"] == transcript(service.engine.tokenizer.decode(tokens))
    assert answer["usage"]["input_tokens"] == len(ids)
    assert answer["usage"]["input_token_details"]["audio_tokens"] == audio_tokens
    return answer


def check_refused(client: TestClient, name: str, message: str, **fields) -> None:
    """A transcription of CLIP with these form fields is one 400 saying `message`."""
    response = transcribe(client, name, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message


def check_an_input_audio_part_replies_as_run_does(client: TestClient, service: Service) -> None:
    """A chat request of CLIP as an input_audio part and "Hi" replies as the single-sequence
    loop does on the prompt `llmrun run` makes of them."""
    response = client.post("/v1/chat/completions", json=audio_body(CLIP, "Hi"))
    assert response.status_code == 200, response.text
    engine = service.engine
    prompt = engine.prompt_text("Hi", audio=1)
    ids, clips = engine.audio_prompt(prompt, [audio.open_audio(CLIP)])
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=clips))
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
