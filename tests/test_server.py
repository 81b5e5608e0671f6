"""`llmrun serve` as a real server in a subprocess, driven by the official openai
client and by raw HTTP: OpenAI response shapes, SSE framing, errors, metrics,
batch-invariant greedy outputs, disconnects and the full queue."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import chat_model_dir, gemma_chat_model_dir, needs_templates
from serving import Server
from starlette.testclient import TestClient

from llmrun import api, paths
from llmrun.sampling import SamplingParams
from llmrun.server import Service, create_app

KEY = "test-key"
ENGINE = api.load(None, device="cpu")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--parallel", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """One slot and room for one waiting request."""
    s = Server(tmp_path_factory.mktemp("serve1"), "--parallel", "1", "--queue", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kwargs)


def run_text(prompt, max_tokens, **params):
    """What `llmrun run --raw` prints for the same prompt."""
    ids = ENGINE.tokenizer.encode(prompt)
    sampling = SamplingParams(**{"temperature": 0, **params})
    return "".join(r.text for r in ENGINE.generate(ids, sampling, max_tokens))


def test_completion_equals_llmrun_run(client):
    result = client.completions.create(
        model="stories260K", prompt="Once upon a time", max_tokens=40, temperature=0
    )
    assert result.object == "text_completion" and result.model == "stories260K"
    assert result.choices[0].text == run_text("Once upon a time", 40)
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 40)
    ids = ENGINE.tokenizer.encode("Once upon a time")
    same = client.completions.create(model="stories260K", prompt=ids, max_tokens=40, temperature=0)
    assert same.choices[0].text == result.choices[0].text


def test_streamed_completion_concatenates_to_the_whole(client):
    stream = client.completions.create(
        model="stories260K", prompt="The little dog", max_tokens=30, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == run_text("The little dog", 30)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_non_streaming_and_streaming_agree(client):
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(
        model="stories260K", messages=messages, max_tokens=25, temperature=0
    )
    message = whole.choices[0].message
    assert whole.object == "chat.completion" and message.role == "assistant"
    assert message.content and not message.content.startswith(" ")
    stream = client.chat.completions.create(
        model="stories260K",
        messages=messages,
        max_tokens=25,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == []
    streamed, first = chunks[-1].usage.model_dump(), whole.usage.model_dump()
    # The same prompt again: its full 16-token blocks come from the prefix cache.
    reused = (first["prompt_tokens"] - 1) // 16 * 16
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert streamed.pop("prompt_tokens_details")["cached_tokens"] == reused
    assert streamed == {k: v for k, v in first.items() if k != "prompt_tokens_details"}


def test_chat_logprobs(client):
    result = client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_a_seed_gives_the_same_text(client):
    def sample():
        result = client.completions.create(
            model="stories260K", prompt="Once", max_tokens=30, temperature=1.0, seed=7
        )
        return result.choices[0].text

    assert sample() == sample() == run_text("Once", 30, temperature=1.0, seed=7)


def test_several_prompts_get_a_choice_each(client):
    """A list of prompts (as lm-eval and vLLM clients send) is answered with one choice
    per prompt, in order, each what `run` gives for it alone; streamed, the chunks of
    each index concatenate to it. It was a 400."""
    prompts = ["Once upon a time", "The little dog", "Tim and Sue"]
    result = client.completions.create(
        model="stories260K", prompt=prompts, max_tokens=12, temperature=0
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [run_text(p, 12) for p in prompts]
    sizes = [len(ENGINE.tokenizer.encode(p)) for p in prompts]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (sum(sizes), 36)
    ids = [ENGINE.tokenizer.encode(p) for p in prompts]
    same = client.completions.create(model="stories260K", prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in same.choices] == [c.text for c in result.choices]
    stream = client.completions.create(
        model="stories260K", prompt=prompts, max_tokens=12, temperature=0, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in result.choices]


def test_n_choices_sample_with_seeds_one_apart(client):
    """`n` choices of a seeded request: choice j is what the request alone gives with
    seed + j, so they differ and the request repeats. Index = prompt x n + choice."""
    alone = [run_text("Once", 20, temperature=1.0, seed=7 + j) for j in range(3)]
    assert len(set(alone)) == 3
    result = client.completions.create(
        model="stories260K", prompt=["Once", "Once"], n=3, max_tokens=20, temperature=1.0, seed=7
    )
    assert [c.index for c in result.choices] == list(range(6))
    assert [c.text for c in result.choices] == alone * 2
    assert result.usage.prompt_tokens == 2 * len(ENGINE.tokenizer.encode("Once"))
    messages = [{"role": "user", "content": "Hi"}]
    chat = dict(model="stories260K", messages=messages, max_tokens=15, temperature=1.0, seed=3)
    one_by_one = [
        client.chat.completions.create(**{**chat, "seed": 3 + j}).choices[0].message.content
        for j in range(2)
    ]
    whole = client.chat.completions.create(**chat, n=2)
    assert [c.message.content for c in whole.choices] == one_by_one
    assert [c.index for c in whole.choices] == [0, 1]
    texts = ["", ""]
    for chunk in client.chat.completions.create(**chat, n=2, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == one_by_one


def test_a_request_for_more_sequences_than_the_server_holds_is_400(one_slot):
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 1}
    response = post(one_slot, "/v1/completions", body, key=None)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "the request asks for 4 sequences (prompts times n), but the server runs 1 at once "
        "and queues 1 more (serve's --parallel and --queue)"
    )


def test_echo_scores_the_prompt_as_transformers_does(client):
    """`echo` with `logprobs` (how lm-eval scores a text): each prompt token's logprob
    and top ones, from every position's logits, equal transformers' log-softmax of the
    same checkpoint within 1e-4; the first token has none. max_tokens 0 scores only."""
    transformers = pytest.importorskip("transformers")
    import torch
    from helpers import STORIES_HF

    text = "Once upon a time there was a little dog named Max. He liked to run"
    ids = ENGINE.tokenizer.encode(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for _ in range(2):  # the second time, the prompt's blocks are in the prefix cache
        scored = client.completions.create(
            model="stories260K", prompt=text, max_tokens=0, echo=True, logprobs=3
        )
        choice = scored.choices[0]
        assert choice.text == text and scored.usage.completion_tokens == 0
        lps = choice.logprobs
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        assert lps.tokens == [ENGINE.tokenizer.token_to_piece(t) for t in ids]
        reference = [float(expected[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lps.token_logprobs[1:] == pytest.approx(reference, abs=1e-4)
        for i, top in enumerate(lps.top_logprobs[1:], start=1):
            values, best = torch.topk(expected[i - 1], 3)
            pieces = [ENGINE.tokenizer.token_to_piece(t) for t in best.tolist()]
            assert list(top) == pieces
            assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
        assert lps.text_offset[:3] == [0, 0, len("Once")]
    generated = client.completions.create(
        model="stories260K", prompt=text, max_tokens=8, echo=True, logprobs=1, temperature=0
    )
    choice = generated.choices[0]
    assert choice.text == text + run_text(text, 8)
    assert len(choice.logprobs.tokens) == len(ids) + 8
    assert choice.logprobs.token_logprobs[: len(ids)] == lps.token_logprobs
    assert choice.logprobs.text_offset[len(ids)] == len(text)
    stream = client.completions.create(
        model="stories260K", prompt=text, max_tokens=8, echo=True, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == choice.text


def test_sse_framing_and_stop(server):
    body = {"prompt": "Once upon a time", "max_tokens": 100, "temperature": 0, "stream": True}
    body["stop"] = ["girl named"]
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ", there was a little "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_end_where_the_text_ends_at_a_stop_string(server, client):
    """Tokens held back as a possible stop string and then cut with it are not
    reported; a token whose text begins in the reply is (llama-server trims the same)."""
    args = dict(model="stories260K", prompt="Once upon a time", max_tokens=30, temperature=0)
    result = client.completions.create(logprobs=1, stop="a little gi", **args)
    text, lps = result.choices[0].text, result.choices[0].logprobs
    assert text == ", there was "
    assert "".join(lps.tokens) == ", there was a"  # ' a' begins with the reply's last space
    assert lps.text_offset == [0, 1, 7, 11]
    chunks = list(client.completions.create(logprobs=1, stop="a little gi", stream=True, **args))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lps.tokens
    # Without a stop string every token is there, offsets where each token's text begins.
    whole = client.completions.create(logprobs=1, **{**args, "max_tokens": 8})
    lps = whole.choices[0].logprobs
    assert "".join(lps.tokens) == whole.choices[0].text and len(lps.tokens) == 8
    assert lps.text_offset == [sum(map(len, lps.tokens[:i])) for i in range(8)]
    chat = client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=30,
        temperature=0,
        logprobs=True,
        stop="Anna",
    )
    content = chat.choices[0].message.content
    assert "".join(e.token for e in chat.choices[0].logprobs.content).startswith(content)
    assert len("".join(e.token for e in chat.choices[0].logprobs.content)) <= len(content) + 4


def test_null_means_the_default_and_logit_bias_counts(server, client):
    body = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0}
    nulls = {"n": None, "stream": None, "logprobs": None, "ignore_eos": None, "echo": None}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    response = post(server, "/v1/completions", {**body, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == plain == run_text("Once upon", 4)
    first = ENGINE.tokenizer.encode("Once upon" + plain)[len(ENGINE.tokenizer.encode("Once upon"))]
    banned = post(server, "/v1/completions", {**body, "logit_bias": {str(first): -100}})
    assert banned.status_code == 200, banned.text
    assert banned.json()["choices"][0]["text"] != plain
    for bad in ({"-1": 1}, {str(ENGINE.tokenizer.vocab_size): 1}, {"x": 1}, {"1": 101}):
        response = post(server, "/v1/completions", {**body, "logit_bias": bad})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"].startswith("logit_bias")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["stories260K"]
    assert client.models.retrieve("stories260K").id == "stories260K"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # The default pool: two contexts per --parallel sequence, in blocks of 16.
    blocks = health.json()["kv_blocks"]
    assert blocks["block_size"] == 16 and blocks["total"] == 2 * 8 * ENGINE.ctx_size // 16
    assert blocks["used"] <= blocks["total"] and blocks["cached"] >= 0


def test_errors_in_openai_shape(server):
    def error(response, status):
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        return body

    chat = "/v1/chat/completions"
    hi = [{"role": "user", "content": "Hi"}]
    bad_json = httpx.post(
        f"{server.url}{chat}",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert "not valid JSON" in error(bad_json, 400)["message"]
    body = error(post(server, chat, {"messages": hi, "temperature": -1}), 400)
    assert body["param"] == "temperature"
    assert error(post(server, chat, {"messages": []}), 400)["param"] == "messages"
    assert error(post(server, chat, {"messages": [{"role": "robot"}]}), 400)
    assert error(post(server, "/v1/completions", {"prompt": "Hi", "n": 17}), 400)["param"] == "n"
    body = error(post(server, "/v1/completions", {"prompt": [[1], []]}), 400)
    assert (body["message"], body["param"]) == ("prompt.1: the prompt is empty", "prompt.1")
    long_prompt = {"prompt": "Once upon a time " * 600, "max_tokens": 5}
    body = error(post(server, "/v1/completions", long_prompt), 400)
    assert re.search(r"the prompt is \d+ tokens, but the context holds 2048", body["message"])
    assert (body["param"], body["code"]) == ("prompt", "context_length_exceeded")
    body = error(post(server, chat, {"model": "gpt-4o", "messages": hi}), 404)
    assert body["code"] == "model_not_found"
    assert error(post(server, chat, {"messages": hi}, key=None), 401)["code"] == "invalid_api_key"
    assert error(post(server, chat, {"messages": hi}, key="wrong"), 401)
    huge = {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    assert error(post(server, chat, huge), 413)
    assert error(httpx.get(f"{server.url}/v1/nowhere"), 404)
    # The server is still well.
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


HOSTILE = [
    b"[]",
    b'"text"',
    b"[" * 100_000,
    b"\xff\xfe{}",
    b'{"prompt": []}',
    b'{"prompt": [1000000000]}',
    b'{"prompt": [[]]}',
    b'{"prompt": [[1], [1000000000]]}',
    b'{"prompt": ["a", 1]}',
    b'{"prompt": "x", "n": 0}',
    b'{"prompt": "x", "stop": "' + b"x" * 1000 + b'"}',
    b'{"prompt": "x", "seed": 1180591620717411303424}',
    b'{"prompt": "x", "logprobs": 50}',
    b'{"prompt": "x", "max_tokens": 0}',
    b'{"prompt": "x", "temperature": "hot"}',
    b'{"prompt": "x", "stream_options": 5}',
    b'{"prompt": "x", "suffix": "y"}',
    b'{"prompt": "x", "echo": "maybe"}',
    b'{"messages": "x"}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}',
]


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_are_refused_with_400(server, body):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = httpx.post(
        f"{server.url}{path}", content=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_concurrent_greedy_requests_equal_one_at_a_time(server):
    prompts = [
        "Once upon a time",
        "The little dog",
        "Lily and Tom went to the park",
        "One day, a big bird",
        "There was a boy named Max who liked",
        "The sun was",
        "A cat and a mouse",
        "Sara wanted to",
    ]

    def complete(prompt):
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "logprobs": 0}
        choice = post(server, "/v1/completions", body).json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]

    one_at_a_time = [complete(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, prompts))
    assert together == one_at_a_time
    assert server.metric("llmrun_requests_total") > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "llmrun_prompt_tokens_total",
        "llmrun_generation_tokens_total",
        "llmrun_time_to_first_token_seconds_bucket",
        "llmrun_time_per_output_token_seconds_bucket",
        "llmrun_requests_waiting",
        "llmrun_requests_running",
    ):
        assert name in metrics


def _long_stream(server):
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60)


def _wait_until_idle(server):
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/health").json()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_disconnected_client_frees_its_slot(one_slot):
    with _long_stream(one_slot) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # The one slot is taken by a 2000-token request unless the disconnect freed it.
    body = {"prompt": "The dog", "max_tokens": 10, "temperature": 0}
    result = post(one_slot, "/v1/completions", body, key=None)
    assert result.json()["choices"][0]["text"] == run_text("The dog", 10)
    _wait_until_idle(one_slot)
    assert one_slot.metric("llmrun_generation_tokens_total") < 2000
    assert one_slot.metric('llmrun_requests_total{endpoint="completions",status="499"}') == 1


def test_a_client_that_gives_up_on_a_whole_reply_frees_its_slot(one_slot):
    """Not streamed, nothing is written until the end: the server asks whether the
    client is still there while the tokens keep coming (before, only when none came for
    a second, so the request ran to max_tokens)."""
    gone = 'llmrun_requests_total{endpoint="completions",status="499"}'
    before, tokens = one_slot.metric(gone), one_slot.metric("llmrun_generation_tokens_total")
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{one_slot.url}/v1/completions", json=body, timeout=0.1)
    _wait_until_idle(one_slot)
    assert one_slot.metric(gone) == before + 1
    context = 512 - 5  # stories260K's, after the prompt; asked after 0.25 s, ~150 tokens here
    assert one_slot.metric("llmrun_generation_tokens_total") - tokens < context


def test_a_full_queue_answers_503_with_retry_after(one_slot):
    with _long_stream(one_slot) as running:
        lines = running.iter_lines()  # dropping the iterator would close the stream
        assert next(lines).startswith("data: ")
        with _long_stream(one_slot) as waiting:
            assert waiting.status_code == 200
            full = post(one_slot, "/v1/completions", {"prompt": "Hi"}, key=None)
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "server_busy"
    _wait_until_idle(one_slot)


def test_health_is_503_while_loading():
    app = create_app(Service("m", set(), None, parallel=1, queue=1))
    with TestClient(app) as http:
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"prompt": "Hi"})
        assert response.status_code == 503 and "loading" in response.json()["error"]["message"]


@needs_templates
def test_chat_uses_the_models_template(tmp_path):
    engine = api.load(str(chat_model_dir(tmp_path / "m")), device="cpu")
    service = Service("m", set(), None, parallel=2, queue=1)
    service.start(engine)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    try:
        with TestClient(create_app(service)) as http:
            body = {"messages": messages, "max_tokens": 12, "temperature": 0}
            result = http.post("/v1/chat/completions", json=body).json()
    finally:
        service.close()
    prompt = engine.tokenizer.encode(engine.render(messages))
    expected = list(engine.generate(prompt, SamplingParams(temperature=0), 12))
    assert result["usage"]["prompt_tokens"] == len(prompt)
    assert result["choices"][0]["message"]["content"] == "".join(r.text for r in expected)
    assert result["choices"][0]["finish_reason"] == expected[-1].finish_reason


def test_ctrl_c_ends_the_requests_in_flight_with_an_error(tmp_path):
    """On SIGINT a stream ends with an error event and [DONE], and a whole reply is a
    503, before the server exits (streams used to be cut off mid-way)."""
    pytest.importorskip("transformers")
    model = chat_model_dir(tmp_path / "m", context=32768)
    s = Server(tmp_path, str(model), "--parallel", "2")
    body = {"prompt": "Hi", "max_tokens": 30000, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=60)
        with httpx.stream(
            "POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            deadline = time.monotonic() + 30
            while httpx.get(f"{s.url}/health").json()["running"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            s.process.send_signal(signal.SIGINT)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["message"] == "the server is shutting down"
        reply = whole.result()
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == "the server is shutting down"
    assert s.process.wait(30) == 128 + signal.SIGINT  # as uvicorn exits on a signal
    assert "Traceback" not in s.log.read_text()


def serve_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmrun", "serve", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_busy_port_is_one_error_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve_cli("--port", str(port))
    assert result.returncode == 2
    assert result.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_model_that_fails_to_load_stops_the_server(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(paths.BUNDLED_MODEL.read_bytes()[:1000])
    result = serve_cli(str(bad), "--port", "0")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(f"error: {bad}: truncated or corrupt GGUF")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def tool(name="get_weather", parameters=None):
    function = {"name": name, "parameters": parameters or WEATHER["function"]["parameters"]}
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"tools": [tool(parameters={"type": "objekt"})]},
            "tools.0.function.parameters",
            "unknown type",
        ),
        (
            {"tools": [tool(parameters={"type": "object", "properties": []})]},
            "tools.0.function.parameters",
            "properties must be an object of schemas",
        ),
        (
            {"tools": [tool(parameters={"type": "string"})]},
            "tools.0.function.parameters",
            "an object schema",
        ),
        ({"tools": [tool(), tool()]}, "tools.1.function.name", "two tools are named 'get_weather'"),
        ({"tools": [tool("get weather")]}, "tools.0.function.name", "not a function name"),
        (
            {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": [tool()]}, "tools", "no chat template, so it cannot take tools"),
    ],
)
def test_bad_tools_are_400(server, extra, param, message):
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert message in error["message"]


def test_tool_choice_none_leaves_the_tools_out_of_a_plain_model(server):
    """A client that always sends its tools turns them off with tool_choice none."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    plain = post(server, "/v1/chat/completions", body)
    response = post(server, "/v1/chat/completions", {**body, "tools": tools, "tool_choice": "none"})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] == plain.json()["choices"][0]["message"]["content"]


def test_a_tool_message_without_its_call_is_400(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for messages, param in [
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "tool", "tool_call_id": "call_1", "content": "x"},
            ],
            "messages.1.tool_call_id",
        ),
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_2", "content": "x"},
            ],
            "messages.2.tool_call_id",
        ),
        ([{"role": "tool", "content": "x"}], "messages.0"),
    ]:
        response = post(server, "/v1/chat/completions", {"messages": messages})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "tool" in error["message"]


def test_kv_memory_and_no_prefix_cache(tmp_path):
    # stories260K: 5 layers x 4 KV heads x 8 values x 16 positions x 4 bytes x 2 = 20480
    # bytes a block, so 120KiB holds 6 blocks (96 tokens).
    s = Server(tmp_path, "--kv-memory", "120KiB", "--no-prefix-cache")
    try:
        health = httpx.get(f"{s.url}/health").json()
        assert health["kv_blocks"] == {"block_size": 16, "total": 6, "used": 0, "cached": 0}
        assert s.metric('llmrun_kv_blocks{state="total"}') == 6
        assert s.metric('llmrun_kv_window_blocks{state="total"}') == 0  # no windowed layers
        long_prompt = list(range(5, 105))
        refused = post(s, "/v1/completions", {"prompt": long_prompt}, key=None)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == (
            "the prompt is 100 tokens, 7 KV blocks of 16, but the KV pool holds 6 blocks "
            "(96 tokens); shorten the prompt or raise --kv-memory"
        )
        body = {"prompt": "Once upon a time there was a little girl", "max_tokens": 8}
        for _ in range(2):
            usage = post(s, "/v1/completions", {**body, "temperature": 0}, key=None).json()["usage"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        _wait_until_idle(s)
        health = httpx.get(f"{s.url}/health").json()
        assert (health["kv_blocks"]["used"], health["kv_blocks"]["cached"]) == (0, 0)
    finally:
        s.stop()


def test_sliding_window_layers_get_a_pool_of_their_own(tmp_path):
    """A tiny Gemma 3 (window 5): its windowed layers' pool is reported beside the full
    layers' one, sized for --parallel sequences' windows and prefill chunks, and the
    rest of --kv-memory goes to the full layer (one of six here)."""
    pytest.importorskip("transformers")
    model = gemma_chat_model_dir(tmp_path / "gemma")
    s = Server(tmp_path, str(model), "--parallel", "2", "--kv-memory", "4MiB")
    try:
        health = httpx.get(f"{s.url}/health").json()
        window = health["kv_blocks"]["window"]
        # Per sequence: blocks for its window and a chunk of 256 (at most its context of
        # 256 positions), and one more; twice.
        assert window == {"positions": 5, "total": 2 * 2 * (16 + 1), "used": 0, "cached": 0}
        # A block of the full layer: 2 KV heads x 32 values x 16 positions x 4 bytes x 2;
        # of the five windowed ones, five times that.
        full, windowed = 8192, 5 * 8192
        assert health["kv_blocks"]["total"] == ((4 << 20) - 68 * windowed) // full == 172
        assert s.metric('llmrun_kv_window_blocks{state="total"}') == 68
        body = {"prompt": "Once upon a time there was a little dog", "max_tokens": 8}
        assert post(s, "/v1/completions", {**body, "temperature": 0}, key=None).status_code == 200
        _wait_until_idle(s)
        health = httpx.get(f"{s.url}/health").json()["kv_blocks"]
        assert health["used"] == health["window"]["used"] == 0
        assert health["window"]["cached"] > 0
    finally:
        s.stop()


def test_a_bad_kv_memory_is_one_error_line():
    result = serve_cli("--kv-memory", "lots")
    assert result.returncode == 2
    assert result.stderr == "error: --kv-memory takes a size such as 4GiB or 512MB, got 'lots'\n"


def test_content_parts_are_joined_by_newlines():
    """As vLLM and llama.cpp join them: two parts are two lines, not one run-on line."""
    from llmrun.server.schema import Message

    parts = [{"type": "text", "text": "Summarize this:"}, {"type": "text", "text": "The cat sat."}]
    message = Message(role="user", content=parts).as_dict()
    assert message["content"] == "Summarize this:\nThe cat sat."
