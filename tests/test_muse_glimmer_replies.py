"""Muse Glimmer's replies: messages `<|start|>assistant to=RECIPIENT<|message|>...` ended by
`<|eom|>` or `<|eot|>`, `to=self` its reasoning, `to=user` its answer, any other recipient a
tool's call in `<atem:function_calls>` markup (llmrun/reasoning.py, llmrun/tool_calls.py).

References: llama.cpp's parser cases for it (tests/test-chat.cpp, "Muse Glimmer format
tests": the model's output after the generation prompt and the reasoning, content and
calls llama.cpp parses it to), read here through serve's reply reader with a real
tokenizer; the real chat template (llama.cpp's models/templates/muse-glimmer.jinja)
rendered by transformers, text and ids, against llmrun's render of a conversation with
tools, a call and its result. What users see comes from a scripted model (tests/scripted.py)
with Muse Glimmer's tokens: under the real template its reply is one message to the user;
under one that opens a message of reasoning in the prompt (as llama.cpp's continuation
does), that reasoning, then the answer. Its tool calls over serve are in
tests/test_tool_calls.py's families ("muse-glimmer")."""

from __future__ import annotations

import json
import re

import pytest
from helpers import TEMPLATES_DIR, TEMPLATES_MISSING
from in_process import llmrun
from scripted import scripted_model_dir

from llmrun import api
from llmrun.generate import Response
from llmrun.reasoning import Harmony
from llmrun.server.reply import Ask, ReplyReader, prepare
from llmrun.tool_calls import detect_format

pytestmark = pytest.mark.skipif(TEMPLATES_MISSING is not None, reason=str(TEMPLATES_MISSING))

TEMPLATE = TEMPLATES_DIR / "muse-glimmer.jinja"
MUSE_TOKENS = [(t, True) for t in ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<|patch|>")]
WORDS = [(w, False) for w in ("assistant", " to=user", "Well")]
# After `<|start|>assistant` (the real template's generation prompt) the chain goes on
# from "assistant": the answer alone; after the opened reasoning's "Well", all of it.
SCRIPT = ["▁the", "▁big", "<|eom|>", "<|start|>", "assistant", " to=user", "<|message|>"]
SCRIPT += ["▁Lily", "▁was", "▁happy", "<|eot|>"]
CALL = (
    '<atem:function_calls>\n<atem:invoke name="special_function">\n'
    '<atem:parameter name="arg1">1</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
)
SPECIAL = {
    "type": "function",
    "function": {
        "name": "special_function",
        "description": "I'm special",
        "parameters": {
            "type": "object",
            "properties": {"arg1": {"type": "integer", "description": "The arg."}},
            "required": ["arg1"],
        },
    },
}
INVOICE = {
    "type": "object",
    "properties": {"amount": {"type": "number"}, "date": {"type": "string"}},
}
HELLO = "Hello, world!\nWhat's up?"
AMOUNT = '{"amount": 123.45, "date": "2025-12-03"}'
# test-chat.cpp's Muse Glimmer cases: output, tools offered, and the reasoning, content
# and calls (name, arguments) llama.cpp parses it to.
LLAMA_CPP_CASES = [
    (f" to=user<|message|>{HELLO}<|eot|>", False, "", HELLO, []),
    (f" to=special_function<|message|>{CALL}", True, "", "", [("special_function", {"arg1": 1})]),
    # inform then act: the answer ends with <|eom|>, a call follows
    (
        f" to=user<|message|>{HELLO}<|eom|><|start|>assistant to=special_function<|message|>{CALL}",
        True,
        "",
        HELLO,
        [("special_function", {"arg1": 1})],
    ),
    # markup quoted in an answer stays its text
    (
        f" to=user<|message|>You invoke it like this:\n{CALL}<|eot|>",
        True,
        "",
        f"You invoke it like this:\n{CALL}",
        [],
    ),
    (f" to=user<|message|>{AMOUNT}", False, "", AMOUNT, []),
    (
        " to=self<|message|>I need to output the invoice details in JSON<|eom|>"
        f"<|start|>assistant to=user<|message|>{AMOUNT}",
        False,
        "I need to output the invoice details in JSON",
        AMOUNT,
        [],
    ),
    # markup in the reasoning is reasoning
    (
        f" to=self<|message|>I could use {CALL} here<|eom|>"
        "<|start|>assistant to=user<|message|>Hello!<|eot|>",
        True,
        f"I could use {CALL} here",
        "Hello!",
        [],
    ),
]


def opens_reasoning(source: str) -> str:
    """The template with a message of reasoning opened after its generation prompt."""
    head, end, tail = source.rpartition("{{- '<|start|>assistant' -}}")
    assert end and "add_generation_prompt" in head[-200:]
    return head + "{{- '<|start|>assistant to=self<|message|>Well' -}}" + tail


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The scripted model's folder, whose own template opens the reasoning."""
    folder = tmp_path_factory.mktemp("muse")
    thinking = opens_reasoning(TEMPLATE.read_text())
    tokens = MUSE_TOKENS + WORDS
    return scripted_model_dir(folder, SCRIPT, thinking, tokens=tokens, eos="<|eot|>", context=4096)


@pytest.fixture(scope="module")
def real(model):
    """The scripted model under the real template."""
    return api.load(str(model), template_file=TEMPLATE)


@pytest.fixture(scope="module")
def thinker(model):
    return api.load(str(model))


def reply_of(engine, output: str, tools: list) -> ReplyReader:
    """Serve's reply reader fed `output` as generation gives it: its tokens one by one (up
    to the end of the turn), each with its text as the streaming detokenizer writes it."""
    fmt = detect_format(engine.template.source)
    prepared = prepare(engine, fmt, Ask([{"role": "user", "content": "Hi"}], tools=tools))
    reader = ReplyReader(engine, prepared)
    decoder = engine.tokenizer.stream(after=prepared.ids)
    tokens = engine.tokenizer.encode(output, add_bos=False)
    end = engine.tokenizer.token_id("<|eot|>")
    tokens = tokens[: tokens.index(end)] if end in tokens else tokens
    for token in tokens:
        reader.feed(Response(decoder.add(token), token, None))
    reader.feed(Response(decoder.flush(), None, None, finish_reason="stop"))
    return reader


@pytest.mark.parametrize(("output", "tools", "reasoning", "content", "calls"), LLAMA_CPP_CASES)
def test_llama_cpp_s_cases_parse_as_llama_cpp_parses_them(
    real, output, tools, reasoning, content, calls
):
    assert isinstance(real.markers, Harmony) and real.markers.channel is None
    reader = reply_of(real, output, [SPECIAL] if tools else [])
    assert (reader.reasoning, reader.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == calls


def test_values_are_read_by_the_tool_s_schema_as_llama_cpp_reads_them():
    """Text where the schema allows a string (may_be_string in llama.cpp's
    common/json-schema.cpp: a string type, a string enum member, one of anyOf's, through
    a reference), JSON otherwise."""
    from llmrun.tool_calls import parse

    properties = {
        "code": {"type": "string"},
        "n": {"type": "integer"},
        "tags": {"type": "array"},
        "note": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/Text"}]},
        "unit": {"enum": ["1", 2]},
        "flag": {},
    }
    params = {"type": "object", "properties": properties, "$defs": {"Text": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    values = {"code": "123", "n": "4", "tags": '["a"]', "note": "null", "unit": "1"}
    values["flag"] = "true"
    markup = "".join(
        f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in values.items()
    )
    text = (
        '<|start|>assistant to=f<|message|><atem:function_calls>\n<atem:invoke name="f">\n'
        f"{markup}</atem:invoke>\n</atem:function_calls>"
    )
    fmt = detect_format(TEMPLATE.read_text()).for_tools([tool])
    content, calls = parse(fmt, text)
    assert content == "" and [c.name for c in calls] == ["f"]
    expected = {"code": "123", "n": 4, "tags": ["a"], "note": "null", "unit": "1", "flag": True}
    assert json.loads(calls[0].arguments) == expected
    # Calls written as the template writes them (for a template that cannot) read back.
    written = fmt.call_text([{"function": {"name": "f", "arguments": expected}}])
    assert written == text
    assert [json.loads(c.arguments) for c in parse(fmt, written)[1]] == [expected]


def test_a_conversation_with_tools_renders_as_transformers_renders_it(tmp_path_factory):
    """The real template in a tiny Muse Glimmer's folder (Meta's tokenizer settings:
    tests/muse_glimmer_helpers.py), through serve's preparation (arguments as OpenAI's JSON
    text, the result's tool named by the call's id), against transformers' tokenizer of
    that folder (MuseGlimmerProcessor's for text) rendering the same conversation
    (arguments as a dict, as the template requires): text and ids."""
    transformers = pytest.importorskip("transformers")
    from muse_glimmer_helpers import folder_of

    folder = folder_of(tmp_path_factory)
    engine = api.load(str(folder))
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "special_function", "arguments": '{"arg1": 1}'},
    }
    history = [
        {"role": "user", "content": "Call it."},
        {"role": "assistant", "content": "", "reasoning_content": "Use it.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    prepared = prepare(engine, detect_format(TEMPLATE.read_text()), Ask(history, tools=[SPECIAL]))
    hf_call = {**call, "function": {**call["function"], "arguments": {"arg1": 1}}}
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    hf_history = [history[0], {**history[1], "tool_calls": [hf_call]}, history[2]]
    text = tokenizer.apply_chat_template(
        hf_history, tools=[SPECIAL], add_generation_prompt=True, tokenize=False
    )
    assert prepared.text == text
    assert (
        "<|start|>assistant to=self<|message|>Use it.<|eom|><|start|>assistant to=special_function"
        f"<|message|>{CALL}<|eot|><|start|>tool special_function<|message|>"
        '<tool_output name="special_function">\ndone\n</tool_output><|eot|><|start|>assistant'
    ) in text
    assert prepared.ids == tokenizer(text, add_special_tokens=False).input_ids


def test_run_shows_the_answer_and_the_reasoning_apart(model):
    # An answer alone passes as generated: "▁Lily" is " Lily" after its header.
    r = llmrun("run", str(model), "Hi", "--temperature", "0", "--template", str(TEMPLATE))
    assert (r.returncode, r.stdout, r.stderr) == (0, " Lily was happy", "")
    r = llmrun("run", str(model), "Hi", "--temperature", "0", "--show-thinking")
    assert r.stdout == "Thinking...\nthe big\n...done thinking.\n\nLily was happy"
    result = json.loads(llmrun("run", str(model), "Hi", "--temperature", "0", "--json").stdout)
    assert (result["text"], result["reasoning"]) == ("Lily was happy", "the big")
    # the big <|eom|>; <|start|> assistant  to=user <|message|> Lily was happy <|eot|>
    assert (result["reasoning_tokens"], result["text_tokens"]) == (3, 8)
    # --reasoning-effort sets the template's reasoning strength, as llama.cpp does
    r = llmrun("run", str(model), "Hi", "-n", "1", "--reasoning-effort", "low", "--show-prompt")
    assert r.returncode == 0 and "Reasoning strength: low." in r.stderr


def test_chat_keeps_the_reasoning_beside_the_answer(thinker):
    from llmrun.chat import ChatSession

    session = ChatSession(thinker, thinker.defaults.updated(temperature=0.0))
    pieces = list(session.send("Hi"))
    assert "".join(pieces) == "the bigLily was happy"
    assert [p.kind for p in pieces] == ["reasoning"] * 2 + ["answer"] * 3
    reply = {"role": "assistant", "content": "Lily was happy", "reasoning_content": "the big"}
    assert session.messages[-1] == reply
    rendered = thinker.render([*session.messages, {"role": "user", "content": "Again"}])
    assert (
        "<|start|>assistant to=self<|message|>the big<|eom|>"
        "<|start|>assistant to=user<|message|>Lily was happy<|eot|>"
    ) in rendered


@pytest.fixture(scope="module")
def http(thinker):
    from serving import served

    yield from served(thinker, "muse")


def test_serve_returns_reasoning_apart_in_each_api(http):
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Lily was happy", "the big")
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    content = [d["content"] for d in deltas if d.get("content")]
    assert (reasoning, content) == (["the", " big"], ["Lily", " was", " happy"])
    anthropic = {"messages": body["messages"], "max_tokens": 32, "temperature": 0}
    blocks = http.post("/v1/messages", json=anthropic).json()["content"]
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in blocks] == [
        ("thinking", "the big"),
        ("text", "Lily was happy"),
    ]
    output = http.post("/v1/responses", json={"input": "Hi", "temperature": 0}).json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == "the big"
    # ollama's think as an effort: the template's reasoning_strength
    ollama = {"model": "muse", "messages": body["messages"], "think": "low", "stream": False}
    message = http.post("/api/chat", json={**ollama, "options": {"temperature": 0}}).json()
    assert (message["message"]["thinking"], message["message"]["content"]) == (
        "the big",
        "Lily was happy",
    )


def test_a_response_format_constrains_the_message_to_the_user(real):
    """The grammar lets the model write its header (here ` to=user<|message|>`, the
    scripted reply's) and then only JSON of the schema, which serve returns as content;
    from the reply's first token, JSON would have had to stand in the header."""
    pytest.importorskip("llguidance")
    from serving import served

    schema = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}},
        "required": ["sunny"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    }
    for http in served(real, "muse"):
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert set(json.loads(choice["message"]["content"])) == {"sunny"}
    assert not re.search(r"to=|<\|", choice["message"]["content"])


def test_a_forced_call_s_grammar_takes_reasoning_first_and_no_answer(real):
    """tool_choice "required": messages of reasoning, then calls of the tool with values of
    its schema (llama.cpp's grammar for it); an answer, or a value not of the schema, is
    refused."""
    pytest.importorskip("llguidance")
    from llmrun import structured

    vocab = structured.vocabulary(real.tokenizer, real.eos_ids)
    fmt = detect_format(TEMPLATE.read_text()).for_tools([SPECIAL])
    grammar = vocab.lark(fmt.grammar([SPECIAL], vocab.token, True), "the tools")
    ids = {t: real.tokenizer.token_id(t) for t in ("<|start|>", "<|message|>", "<|eom|>")}

    def accepts(output: str) -> bool:
        constraint = grammar.constraint()
        try:
            for part in re.split(r"(<\|[a-z]+\|>)", output):
                for token in [ids[part]] if part in ids else vocab.tokenize(part):
                    constraint.accept(token)
        except structured.GrammarError:
            return False
        return constraint.matcher.is_accepting()

    thought = " to=self<|message|>I could use it.<|eom|><|start|>assistant"
    call = f" to=special_function<|message|>{CALL}"
    assert accepts(call) and accepts(thought + call)
    assert accepts(f"{call}<|eom|><|start|>assistant{call}")  # parallel calls
    assert not accepts(f" to=user<|message|>{HELLO}")
    assert not accepts(call.replace(">1<", ">one<"))
