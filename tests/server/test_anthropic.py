"""serve's /v1/messages (llmrun.server.anthropic) driven by the official anthropic client
through the app's test client: plain and streamed messages, stop sequences, max_tokens,
thinking, tools with a tool_use round trip, count_tokens, and errors in Anthropic's shape.
Each reply's text equals /v1/chat/completions' for the same conversation, and each stream
rebuilds the message a request without `stream` gets."""

from __future__ import annotations

import base64
import json

import pytest
from helpers import TEMPLATES_MISSING
from starlette.testclient import TestClient
from tool_families import FAMILIES, RESULT, WEATHER

from llmrun import api
from llmrun.server import Service, create_app
from llmrun.server.anthropic import CountBody, conversation

GREEDY = {"temperature": 0}  # the client has no temperature argument: an extra body field
TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
HI = [{"role": "user", "content": "Once upon a time"}]
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def serve(engine, name: str, api_key: str | None = None):
    service = Service(name, set(), api_key, parallel=2, queue=4)
    service.start(engine)
    return service, TestClient(create_app(service))


def client(http: TestClient, api_key: str = "-"):
    """The anthropic client over the app's test client (imported here, not at collection:
    its import takes seconds in every test worker)."""
    import anthropic

    return anthropic.Anthropic(
        base_url=str(http.base_url), api_key=api_key, http_client=http, max_retries=0
    )


@pytest.fixture(scope="module")
def stories():
    """The bundled stories260K (no chat template): a client and the raw HTTP client."""
    service, http = serve(api.load(None, device="cpu"), "stories")
    with http:
        yield client(http), http
    service.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A scripted Qwen3 under its real template: it thinks, calls get_weather, then answers."""
    if TEMPLATES_MISSING:
        pytest.skip(TEMPLATES_MISSING)
    model = FAMILIES["qwen3"].model_dir(tmp_path_factory.mktemp("qwen3"))
    service, http = serve(api.load(str(model), device="cpu"), "qwen3")
    with http:
        yield client(http), http
    service.close()


def chat_content(http, messages, **fields) -> dict:
    body = {"messages": messages, "temperature": 0, **fields}
    return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]


def events(http, body: dict) -> list[tuple[str, dict]]:
    """A stream's (event name, data) pairs, each name checked against its data's type."""
    out = []
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append((event["type"], event))
    return out


def without_ids(message) -> dict:
    value = message.model_dump(exclude_none=True)
    value.pop("id")
    value["usage"].pop("cache_read_input_tokens")  # the second request finds the prefix
    value["usage"].pop("input_tokens")
    return value


def test_blocks_become_chat_messages():
    body = CountBody.model_validate(
        {
            "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Hm.", "signature": ""},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                        {"type": "text", "text": "And?"},
                    ],
                },
            ],
        }
    )
    assert conversation(body) == [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Hm.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "And?"},
    ]


def test_a_message_equals_the_chat_completion(stories):
    client, http = stories
    args = dict(model="stories", max_tokens=12, messages=HI, extra_body=GREEDY)
    message = client.messages.create(**args)
    expected = chat_content(http, HI, max_tokens=12)["content"]
    assert (message.type, message.role, message.model) == ("message", "assistant", "stories")
    assert message.id.startswith("msg_") and message.content[0].text == expected
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    counted = client.messages.count_tokens(model="stories", messages=HI).input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted
    assert message.usage.output_tokens == 12

    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(message)
    names = [name for name, _ in events(http, {**args.pop("extra_body"), **args})]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_message(stories):
    client, _ = stories
    text = (
        client.messages.create(model="stories", max_tokens=20, messages=HI, extra_body=GREEDY)
        .content[0]
        .text
    )
    word = text.split()[2]
    args = dict(model="stories", max_tokens=20, messages=HI, extra_body=GREEDY)
    message = client.messages.create(stop_sequences=["zzz", word], **args)
    assert message.content[0].text == text[: text.index(word)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)
    with client.messages.stream(stop_sequences=["zzz", word], **args) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)
    assert final.content[0].text == message.content[0].text


def test_thinking_and_a_tool_use_round_trip(qwen3):
    client, http = qwen3
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model="qwen3", max_tokens=40, tools=[TOOL], extra_body=GREEDY)
    message = client.messages.create(
        messages=question, thinking={"type": "enabled", "budget_tokens": 1024}, **args
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    thinking, call = message.content
    assert thinking.thinking == "the big"
    assert (call.name, call.input, message.stop_reason) == (
        "get_weather",
        {"city": "Paris"},
        "tool_use",
    )
    with client.messages.stream(messages=question, **args) as stream:
        final = stream.get_final_message()
    streamed, whole = without_ids(final), without_ids(message)
    assert streamed["content"][1].pop("id").startswith("call_")
    whole["content"][1].pop("id")
    assert streamed == whole
    body = {"model": "qwen3", "max_tokens": 40, "tools": [TOOL], "messages": question, **GREEDY}
    deltas = [e["delta"]["type"] for name, e in events(http, body) if name == "content_block_delta"]
    assert set(deltas) == {"thinking_delta", "input_json_delta"}

    # The tool's result goes back: the model answers, as /v1/chat/completions does.
    history = [
        *question,
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}],
        },
    ]
    answer = client.messages.create(messages=history, **args)
    assert [block.type for block in answer.content] == ["text"]
    assert (answer.content[0].text, answer.stop_reason) == ("It is sunny in Paris.", "end_turn")
    chat_history = [
        *question,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "the big",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    chat = chat_content(http, chat_history, tools=[WEATHER], max_tokens=40)
    assert chat["content"] == answer.content[0].text
    counted = client.messages.count_tokens(model="qwen3", messages=history, tools=[TOOL])
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_tool_choice_and_the_thinking_switch(qwen3):
    client, http = qwen3
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": RESULT}],
        },
    ]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        message = client.messages.create(
            model="qwen3",
            max_tokens=200,
            messages=history,
            tools=[TOOL],
            tool_choice=choice,
            extra_body=GREEDY,
        )
        assert [block.type for block in message.content] == ["tool_use"]
        assert message.content[0].input["city"] in ("Paris", "Rome")
    # Qwen3's template writes an empty thinking block where thinking is off.
    count = {"model": "qwen3", "messages": history[:1]}
    on = http.post("/v1/messages/count_tokens", json=count).json()["input_tokens"]
    off = http.post(
        "/v1/messages/count_tokens", json={**count, "thinking": {"type": "disabled"}}
    ).json()["input_tokens"]
    assert off > on


def test_an_image_block_is_the_image_chat_takes(tmp_path):
    pytest.importorskip("PIL")
    from vision_helpers import picture, save_gemma3_vl_dir, tiny_gemma3_vl

    folder = save_gemma3_vl_dir(tiny_gemma3_vl(), tmp_path / "gemma3-vl")
    service, http = serve(api.load(str(folder), device="cpu", vision=True), "gemma3")
    data = base64.b64encode(picture(48, 80, 1)).decode()
    source = {"type": "base64", "media_type": "image/png", "data": data}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "What is it?"}]
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "What is it?"},
    ]
    with http:
        body = {
            "model": "gemma3",
            "max_tokens": 6,
            "messages": [{"role": "user", "content": content}],
        }
        message = http.post("/v1/messages", json={**body, **GREEDY}).json()
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": parts}], "max_tokens": 6, **GREEDY},
        ).json()
        counted = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        url = {"type": "url", "url": "https://example.com/a.png"}
        refused = http.post(
            "/v1/messages",
            json={
                **body,
                "messages": [{"role": "user", "content": [{"type": "image", "source": url}]}],
            },
        )
    service.close()
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert counted == chat["usage"]["prompt_tokens"]
    assert refused.status_code == 400 and "fetches nothing" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "kind", "message"),
    [
        ({"messages": HI}, 400, "invalid_request_error", "max_tokens: Field required"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": PNG}]}],
            },
            400,
            "invalid_request_error",
            "takes no images",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "no earlier tool_use block",
        ),
        (
            {
                "max_tokens": 5,
                "messages": HI,
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            400,
            "invalid_request_error",
            "only custom tools",
        ),
        (
            {"max_tokens": 5, "messages": HI, "tools": [TOOL], "tool_choice": {"type": "tool"}},
            400,
            "invalid_request_error",
            "tool_choice of type tool needs a name",
        ),
        ({"max_tokens": 5, "messages": HI, "model": "claude"}, 404, "not_found_error", "'claude'"),
    ],
)
def test_errors_in_anthropic_shape(stories, body, status, kind, message):
    client, http = stories
    response = http.post("/v1/messages", json=body)
    assert response.status_code == status
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == kind and message in error["error"]["message"]


def test_the_client_sees_errors_and_sends_its_key():
    import anthropic

    service, http = serve(api.load(None, device="cpu"), "stories", api_key="secret")
    with http:
        args = dict(model="stories", max_tokens=3, messages=HI)
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(http, "nope").messages.create(**args)
        assert e.value.body["error"]["type"] == "authentication_error"
        right = client(http, "secret")
        assert right.messages.create(**args).usage.output_tokens == 3
        with pytest.raises(anthropic.BadRequestError):
            right.messages.create(model="stories", max_tokens=3, messages=[])
    service.close()
