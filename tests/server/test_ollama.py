"""serve's ollama API, driven over HTTP (the app served in this process) by the official
`ollama` client, whose pydantic models parse every reply: /api/chat and /api/generate
(whole and NDJSON streams, greedy and seeded text equal to /v1's, options, format, tools,
think, images, context, an error line ending a stream), /api/embed and /api/embeddings
against transformers, /api/tags, /api/show, /api/ps, /api/version, errors in ollama's
shape.

Tolerances: text and token counts exact; vectors within 1e-4 of transformers'."""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Literal

import gguf
import httpx
import ollama
import pytest
import torch
import uvicorn
from embedding_helpers import TEXTS, hf_model, reference, write_embedding_dir
from helpers import needs_templates
from pydantic import BaseModel, Field
from tool_families import FAMILIES, RESULT, WEATHER

from llmrun import api, paths
from llmrun.server import Service, bind, create_app

MESSAGES = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0}


def serve(engine: api.Engine, name: str):
    """The app serving `engine` in this process, over HTTP on a free port (a thread of
    uvicorn: no second load of the model), as (raw HTTP client, ollama client, service)."""
    service = Service(name, set(), None, parallel=4, queue=4)
    service.start(engine)
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(create_app(service), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http, ollama.Client(host=url), service
    finally:
        server.should_exit = True
        thread.join(30)
        service.close()
        sock.close()


@pytest.fixture(scope="module")
def stories():
    for http, client, _ in serve(api.load(None, device="cpu"), "stories260K"):
        yield http, client


def ndjson(http, path, body):
    """A streamed reply's lines, each parsed, after checking the framing."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-ndjson"
        text = response.read().decode()
    assert text.endswith("\n")
    return [json.loads(line) for line in text[:-1].split("\n")]


def test_chat_text_equals_v1_chat_completions(stories):
    http, client = stories
    v1 = http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 20, **GREEDY}
    ).json()
    options = {**GREEDY, "num_predict": 20}
    whole = client.chat(model="stories260K", messages=MESSAGES, options=options)
    assert whole.message.role == "assistant"
    assert whole.message.content == v1["choices"][0]["message"]["content"]
    assert (whole.done, whole.done_reason, whole.eval_count) == (True, "length", 20)
    assert whole.prompt_eval_count == v1["usage"]["prompt_tokens"]
    assert whole.model == "stories260K"

    parts = list(client.chat(model="stories260K", messages=MESSAGES, options=options, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    assert (last.done_reason, last.eval_count, last.message.content) == ("length", 20, "")
    assert last.prompt_eval_count == whole.prompt_eval_count


def test_ndjson_framing_and_durations(stories):
    http, _ = stories
    body = {"model": "stories260K:latest", "messages": MESSAGES, "options": {"num_predict": 5}}
    lines = ndjson(http, "/api/chat", body)
    for line in lines[:-1]:
        assert set(line) == {"model", "created_at", "message", "done"}
        assert line["done"] is False and line["model"] == "stories260K:latest"
    final = lines[-1]
    durations = ("total_duration", "prompt_eval_duration", "eval_duration", "load_duration")
    assert all(isinstance(final[k], int) and final[k] >= 0 for k in durations)
    assert final["total_duration"] >= max(final["prompt_eval_duration"], final["eval_duration"])
    assert final["created_at"].endswith("Z") and final["done_reason"] == "length"


def test_options_map_to_the_sampler(stories):
    http, client = stories
    sampled = {"temperature": 0.9, "seed": 7, "top_k": 5, "top_p": 0.9, "repeat_penalty": 1.1}
    v1 = http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 15, **sampled}
    ).json()
    # Options ollama has and llmrun does not (num_ctx, mirostat) are ignored, as ollama does.
    options = {**sampled, "num_predict": 15, "num_ctx": 1 << 20, "mirostat": 1}
    reply = client.chat(model="stories260K", messages=MESSAGES, options=options)
    assert reply.message.content == v1["choices"][0]["message"]["content"]
    stop = v1["choices"][0]["message"]["content"].split()[1]
    cut = client.chat(model="stories260K", messages=MESSAGES, options={**options, "stop": [stop]})
    assert cut.done_reason == "stop" and stop not in cut.message.content


def test_generate_equals_v1_completions_and_returns_its_context(stories):
    http, client = stories
    prompt = "Once upon a time"
    v1 = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, **GREEDY}).json()
    reply = client.generate(
        model="stories260K", prompt=prompt, options={**GREEDY, "num_predict": 12}
    )
    assert reply.response == v1["choices"][0]["text"] and reply.done_reason == "length"
    tokenizer = api.load(None, device="cpu").tokenizer
    ids = tokenizer.encode(prompt)
    assert list(reply.context[: len(ids)]) == ids and len(reply.context) == len(ids) + 12
    assert tokenizer.decode(list(reply.context[len(ids) :])) == reply.response

    # The context goes back with the next prompt: the conversation so far, then the prompt.
    more = client.generate(
        model="stories260K",
        prompt=" The end.",
        context=reply.context,
        options={**GREEDY, "num_predict": 8},
    )
    follow = list(reply.context) + tokenizer.encode(" The end.", add_bos=False)
    v1 = http.post("/v1/completions", json={"prompt": follow, "max_tokens": 8, **GREEDY}).json()
    assert more.response == v1["choices"][0]["text"]

    streamed = list(
        client.generate(
            model="stories260K",
            prompt=prompt,
            raw=True,
            options={**GREEDY, "num_predict": 12},
            stream=True,
        )
    )
    assert "".join(p.response for p in streamed) == reply.response
    assert streamed[-1].context is None  # raw: no context, as ollama


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    degrees: int = Field(ge=-40, le=50)
    sunny: bool


def test_format_takes_a_schema_or_json(stories):
    _, client = stories
    reply = client.chat(
        model="stories260K", messages=MESSAGES, format=Weather.model_json_schema(), options=GREEDY
    )
    Weather.model_validate_json(reply.message.content)
    # Any JSON object: this model's one goes on past a few tokens.
    options = {**GREEDY, "num_predict": 30}
    generated = client.generate(
        model="stories260K", prompt="Weather:", format="json", options=options
    )
    assert generated.response.startswith("{") and generated.done_reason == "length"


def test_tags_show_ps_and_version(stories):
    http, client = stories
    reader = gguf.GGUFReader(paths.BUNDLED_MODEL)
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    [model] = client.list().models
    assert model.model == "stories260K:latest" and model.size == paths.BUNDLED_MODEL.stat().st_size
    details = model.details
    assert (details.format, details.family, details.quantization_level) == ("gguf", "llama", "F32")
    assert details.parameter_size == f"{parameters / 1e3:.2f}K" == "292.80K"
    assert len(model.digest) == 64

    shown = client.show("stories260K")
    assert shown.capabilities == ["completion"] and shown.template == ""
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["general.parameter_count"] == parameters
    assert shown.modelinfo["llama.context_length"] == 2048
    assert "temperature" in shown.parameters and "FROM " in shown.modelfile

    [running] = client.ps().models
    assert running.name == "stories260K:latest" and running.context_length == 2048
    assert running.size > model.size and running.size_vram == 0
    assert http.get("/api/version").json() == {"version": "0.12.0"}
    assert http.get("/").text == "Ollama is running"
    assert http.head("/").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/api/chat", {"model": "nope", "messages": MESSAGES}, 404, "does not exist"),
        ("/api/show", {"model": "nope"}, 404, "does not exist"),
        ("/api/chat", {"messages": MESSAGES, "options": {"temperature": -1}}, 400, "temperature"),
        ("/api/chat", {"messages": MESSAGES, "think": True}, 400, "does not support thinking"),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "Hi", "images": ["AAAA"]}]},
            400,
            "takes no images",
        ),
        ("/api/generate", {"prompt": "Hi", "template": "{{ .System }} {{ .Prompt }}"}, 400, "raw"),
        ("/api/generate", {"prompt": "Hi", "context": [10**9]}, 400, "context"),
        (
            "/api/chat",
            {"messages": [{"role": "tool", "content": "1", "tool_name": "f"}]},
            400,
            "answers no call",
        ),
        ("/api/generate", {"prompt": "def f(", "suffix": "x"}, 400, "fill-in-the-middle"),
        ("/api/generate", {"prompt": "Hi", "system": "Be brief."}, 400, "system message"),
        ("/api/embed", {"input": "Hi"}, 400, "pooling"),
    ],
)
def test_errors_in_ollamas_shape(stories, path, body, status, message):
    http, _ = stories
    response = http.post(path, json={"stream": False, **body})
    assert response.status_code == status
    assert list(response.json()) == ["error"] and message in response.json()["error"]


def test_a_stream_cut_short_ends_with_an_error_line():
    for http, _, service in serve(api.load(None, device="cpu"), "stories260K"):
        body = {"messages": MESSAGES, "options": {"num_predict": 2000}}
        with http.stream("POST", "/api/chat", json=body) as response:
            lines = response.iter_lines()
            assert json.loads(next(lines))["done"] is False
            service.close()  # as on Ctrl-C: the requests in flight end
            rest = [json.loads(line) for line in lines]
    assert rest[-1] == {"error": "the server is shutting down"}


def test_nothing_to_say_loads_the_model(stories):
    _, client = stories
    assert client.chat(model="stories260K", messages=[]).done_reason == "load"
    assert client.generate(model="stories260K").done_reason == "load"


# --- tools and thinking: a scripted Qwen3 under its real template -----------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model = FAMILIES["qwen3"].model_dir(tmp_path_factory.mktemp("qwen3"))
    for http, client, _ in serve(api.load(str(model), device="cpu"), "qwen3"):
        yield http, client


@needs_templates
def test_a_tool_call_round_trip_with_thinking(qwen3):
    http, client = qwen3
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model="qwen3", tools=[WEATHER], think=True, options=GREEDY)
    reply = client.chat(messages=ask, **args)
    message = reply.message
    assert (message.thinking, message.content, reply.done_reason) == ("the big", "", "stop")
    [call] = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris"})
    assert client.show("qwen3").capabilities == ["completion", "tools", "thinking"]

    parts = list(client.chat(messages=ask, stream=True, **args))
    assert "".join(p.message.thinking or "" for p in parts) == "the big"
    streamed = [c for p in parts for c in p.message.tool_calls or ()]
    assert streamed == [call]

    # The client sends the call back with the tool's result, named by tool_name.
    history = [*ask, message, {"role": "tool", "content": RESULT, "tool_name": "get_weather"}]
    answer = client.chat(messages=history, **args)
    assert answer.message.content == "It is sunny in Paris." and not answer.message.tool_calls

    generated = client.generate(model="qwen3", prompt="Weather?", think=True, options=GREEDY)
    assert generated.thinking == "the big"


# --- embeddings: a tiny Qwen3 embedding model against transformers ----------------------


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    model = hf_model()
    folder = write_embedding_dir(tmp_path_factory.mktemp("qwen3-embedding"), model)
    engine = api.load(str(folder), device="cpu", generate=False)
    for http, client, _ in serve(engine, "qwen3-embedding"):
        yield http, client, model, engine


def test_embed_and_embeddings_equal_transformers(embedder):
    http, client, model, engine = embedder
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    result = client.embed(model="qwen3-embedding", input=TEXTS)
    torch.testing.assert_close(
        torch.tensor(result.embeddings), reference(model, ids), atol=1e-4, rtol=0
    )
    assert result.prompt_eval_count == sum(len(i) for i in ids)

    cut = client.embed(model="qwen3-embedding", input=TEXTS[0], dimensions=8)
    expected = reference(model, ids[:1], normalize=False)[:, :8]
    expected = expected / expected.norm(dim=1, keepdim=True)
    torch.testing.assert_close(torch.tensor(cut.embeddings), expected, atol=1e-4, rtol=0)

    old = client.embeddings(model="qwen3-embedding", prompt=TEXTS[1])
    raw = reference(model, ids[1:2], normalize=False)[0]
    torch.testing.assert_close(torch.tensor(old.embedding), raw, atol=1e-4, rtol=1e-4)
    assert "embedding" in client.show("qwen3-embedding").capabilities


# --- images: a tiny random Gemma 3 with its vision tower --------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    pytest.importorskip("PIL")
    from vision_helpers import save_gemma3_vl_dir, tiny_gemma3_vl

    folder = save_gemma3_vl_dir(tiny_gemma3_vl(), tmp_path_factory.mktemp("gemma3-vl"))
    for http, client, _ in serve(api.load(str(folder), device="cpu", vision=True), "gemma3"):
        yield http, client


def test_images_pass_through_as_v1s_image_parts(gemma3):
    from vision_helpers import picture

    http, client = gemma3
    red = picture(48, 80, 1)
    url = "data:image/png;base64," + base64.b64encode(red).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 8, **GREEDY}
    v1 = http.post("/v1/chat/completions", json=body).json()
    expected = v1["choices"][0]["message"]
    options = {**GREEDY, "num_predict": 8}
    asked = [{"role": "user", "content": "What?", "images": [red]}]
    reply = client.chat(model="gemma3", messages=asked, options=options)
    assert reply.message.content == expected["content"]
    assert reply.prompt_eval_count == v1["usage"]["prompt_tokens"]  # the image's tokens too
    generated = client.generate(model="gemma3", prompt="What?", images=[red], options=options)
    assert generated.response == expected["content"]
    assert "vision" in client.show("gemma3").capabilities
