"""serve's /v1/audio/transcriptions with a tiny random Qwen3-ASR (qwen3_asr_helpers): the
prompt ids are those of transformers' Qwen3ASRProcessor.apply_transcription_request, with
a language (its "language English<asr_text>" suffix), without (the model names the language
itself) and with a context (OpenAI's `prompt`, the processor's system turn), and the reply
is transformers' greedy generation on them (the context ends it, a random model not
stopping) read as Qwen3ASRProcessor.parse_output reads it, as json and as text. A language
Qwen3-ASR was not trained with is one clear 400. A chat request's input_audio part replies
as run does.

Tolerances: ids and text exact.
"""

import base64

import pytest
import torch
from qwen3_asr_helpers import processor, save_qwen3_asr_dir, tiny_qwen3_asr
from serving import GREEDY
from starlette.testclient import TestClient
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, qwen3_asr_clips
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")
CLIP = wav_bytes(chirp(1.3, 16000, seed=3), 16000)
# The prompt (a user turn of the clip's 17 tokens, the assistant's turn begun; 50 tokens
# with a language, which the tiny tokenizer spells letter by letter) and some 20 tokens of
# answer.
CONTEXT = 72


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_asr(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qwen3_asr_dir(model, tmp_path_factory.mktemp("qwen3-asr"))


@pytest.fixture(scope="module")
def service(folder):
    engine = api.load(str(folder), device="cpu", audio=True, ctx_size=CONTEXT)
    service = Service("qwen3-asr", set(), None, parallel=1, queue=4)
    service.start(engine)
    yield service
    service.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as http:
        yield http


def transcribe(client, **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(
        "/v1/audio/transcriptions", data={"model": "qwen3-asr", **fields}, files=files
    )


@pytest.mark.parametrize(("language", "context"), [("en", None), (None, None), ("de", "Ada")])
def test_a_transcription_is_transformers_on_apply_transcription_request_s_ids(
    client, service, model, folder, monkeypatch, language, context
):
    prompts = []
    submit = service.scheduler.submit

    def recorded(request, on_event):
        prompts.append(request.prompt)
        return submit(request, on_event)

    monkeypatch.setattr(service.scheduler, "submit", recorded)
    fields = {"language": language} if language else {}
    fields |= {"prompt": context} if context else {}
    response = transcribe(client, **fields)
    assert response.status_code == 200, response.text
    made = processor(folder)
    samples = audio.open_audio(CLIP).samples
    inputs = made.apply_transcription_request(samples, language=language, prompt=context)
    ids = inputs["input_ids"][0].tolist()
    assert prompts == [ids]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=CONTEXT + 1 - len(ids), do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    # llmrun's decode, whose byte tokens' text (the random model writes many) is not
    # transformers' replacement characters; read as parse_output reads it (whose own
    # reading tests/models/test_qwen3_asr.py checks).
    text = qwen3_asr_clips.transcript(service.engine.tokenizer.decode(tokens))
    answer = response.json()
    assert answer["text"] == text
    assert answer["usage"]["input_tokens"] == len(ids)
    assert answer["usage"]["input_token_details"]["audio_tokens"] == 17
    assert answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"] == CONTEXT + 1
    plain = transcribe(client, response_format="text", **fields)
    assert plain.text == text


def test_a_language_it_was_not_trained_with_is_one_400(client):
    response = transcribe(client, language="sw")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "language 'sw': Qwen3-ASR transcribes ar, cs, da, de, el, en, es, fa, fi, fr, hi"
    )


def test_an_input_audio_part_replies_as_run_does(client, service):
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(CLIP).decode(), "format": "wav"},
    }
    content = [part, {"type": "text", "text": "Hi"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    engine = service.engine
    prompt = engine.prompt_text("Hi", audio=1)
    ids, clips = engine.audio_prompt(prompt, [audio.open_audio(CLIP)])
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=clips))
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
