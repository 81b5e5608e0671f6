"""/v1/responses: input items as a conversation, and over a real `llmrun serve` the openai
client's responses.create and responses.stream (reasoning, function calls and their
outputs, structured text, max_output_tokens), each stream rebuilding the whole response."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from helpers import TEMPLATES_MISSING
from pydantic import BaseModel, Field
from serving import Server
from tool_families import FAMILIES, RESULT, WEATHER

from llmrun.server.responses import ResponsesBody, conversation, responses_ask
from llmrun.server.schema import ApiError

TOOL = {"type": "function", **WEATHER["function"]}


def body(**fields):
    return ResponsesBody.model_validate(fields)


def test_input_items_become_a_conversation():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Hm."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny."}],
        },
        {"role": "developer", "content": "Be brief."},
    ]
    assert conversation(body(input=items, instructions="You help.")) == [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Hm.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "system", "content": "Be brief."},
    ]
    assert conversation(body(input="Hi")) == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]},
            "input.0.call_id",
            "no earlier function_call",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "stores no responses"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role", "must be one of"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.image_url",
            "needs an image_url",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input.0.type", "unsupported input item"),
        (
            {"input": "Hi", "instructions": None, "previous_response_id": "resp_1"},
            "previous_response_id",
            "stateless",
        ),
        ({"input": "Hi", "store": True}, "store", "stateless"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
        ({"input": "Hi", "tools": [TOOL, TOOL]}, "tools.1.function.name", "two tools"),
        (
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format",
            "needs a schema",
        ),
    ],
)
def test_requests_refused_with_the_parameter(fields, param, message):
    class Engine:
        def switches(self, effort=None, kwargs=None):
            return {}

    with pytest.raises(ApiError) as e:
        responses_ask(Engine(), body(**fields))
    assert (e.value.status, e.value.param) == (400, param)
    assert message in e.value.message


# ---- a real server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A scripted Qwen3 under its real template: it thinks, calls get_weather, then answers."""
    if TEMPLATES_MISSING:
        pytest.skip(TEMPLATES_MISSING)
    model = FAMILIES["qwen3"].model_dir(tmp_path_factory.mktemp("qwen3"))
    server = Server(tmp_path_factory.mktemp("serve"), str(model))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0), model.name
    server.stop()


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("serve"))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0), server
    server.stop()


# input_tokens_details: a repeated input finds its blocks in the prefix cache.
IDS = ("id", "call_id", "item_id", "created_at", "input_tokens_details")


def without_ids(value):
    """A response (or event) as a dict, without what differs from one request to the next."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in IDS}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def streamed(client, **args):
    """The final response that responses.stream rebuilds from its events, and the events."""
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    return final, events


def test_a_function_call_round_trip(qwen3):
    client, name = qwen3
    args = dict(model=name, input="What is the weather in Paris?", tools=[TOOL], temperature=0)
    reply = client.responses.create(**args)
    assert reply.status == "completed" and reply.object == "response"
    assert [item.type for item in reply.output] == ["reasoning", "function_call"]
    reasoning, call = reply.output
    assert reasoning.content[0].text == "the big"
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call.call_id.startswith("call_") and reply.output_text == ""
    assert reply.usage.output_tokens_details.reasoning_tokens == 4

    final, events = streamed(client, **args)
    assert without_ids(final) == without_ids(reply)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert {"response.reasoning_text.delta", "response.function_call_arguments.delta"} <= set(kinds)
    delta = next(e for e in events if e.type == "response.function_call_arguments.delta")
    assert delta.delta == call.arguments and delta.output_index == 1

    # The call's output goes back with the items: the model answers.
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in reply.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
    ]
    answer = client.responses.create(**{**args, "input": items})
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == "It is sunny in Paris."
    message = answer.output[0]
    assert (message.role, message.status, message.content[0].type) == (
        "assistant",
        "completed",
        "output_text",
    )
    final, events = streamed(client, **{**args, "input": items})
    assert without_ids(final) == without_ids(answer)
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == answer.output_text
    )
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == answer.output_text


def test_a_named_tool_choice_forces_the_call(qwen3):
    client, name = qwen3
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    items = [
        {"role": "user", "content": "Weather?"},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
    ]
    reply = client.responses.create(
        model=name,
        input=items,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    assert [item.type for item in reply.output] == ["function_call"]
    assert json.loads(reply.output[0].arguments)["city"] in ("Paris", "Rome")


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    degrees: int = Field(ge=-40, le=50)
    sunny: bool


def test_structured_text_and_instructions(stories):
    client, _ = stories
    args = dict(
        model="stories260K", input="The weather?", instructions="Answer in JSON.", temperature=0
    )
    parsed = client.responses.parse(text_format=Weather, **args)
    assert isinstance(parsed.output_parsed, Weather)
    assert parsed.text.format.type == "json_schema"
    plain = client.responses.create(
        text={"format": {"type": "json_object"}}, max_output_tokens=40, **args
    )
    assert plain.output_text.startswith("{")


def test_max_output_tokens_leaves_the_response_incomplete(stories):
    client, _ = stories
    args = dict(model="stories260K", input="Once upon a time", max_output_tokens=5, temperature=0)
    reply = client.responses.create(**args)
    assert (reply.status, reply.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert reply.usage.output_tokens == 5 and reply.output_text
    assert [item.status for item in reply.output] == ["incomplete"]  # the message cut off
    with client.responses.stream(**args) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert without_ids(events[-1].response) == without_ids(reply)
    # The same 19 input tokens again: their full 16-token block is reused.
    assert reply.usage.input_tokens_details.cached_tokens == 0
    assert events[-1].response.usage.input_tokens_details.cached_tokens == 16


def test_stateless_requests_are_400(stories):
    client, server = stories
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="stories260K", input="Hi", previous_response_id="resp_1")
    assert "stateless" in str(e.value) and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="stories260K", input="Hi", store=True)
    assert e.value.body["param"] == "store"
    import httpx

    r = httpx.post(f"{server.url}/v1/responses", json={"input": []})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
