"""Reasoning told apart from the answer: the splitter on exact token streams, and what a user
sees from `run`, `chat` and `serve` with a scripted model that thinks (tests/scripted.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from in_process import llmrun
from scripted import OPENS_THINK_TEMPLATE, scripted_model_dir

from llmrun.errors import UsageError
from llmrun.reasoning import ANSWER, REASONING, Markers, Splitter, find_markers, template_switches

THINKS = ["<think>", "▁the", "▁big", "</think>", "▁Lily", "▁was", "▁happy"]
M = Markers(open_id=1, close_id=2)


def split(stream, prompt="", markers=M):
    s = Splitter(markers, prompt)
    pieces = [(p.kind, str(p)) for token, text in stream for p in s.feed(token, text)]
    return pieces, s


def test_splitter_trims_the_reasoning_and_the_answer_that_follows_it():
    stream = [(1, "<think>"), (3, "\n"), (4, "Hmm"), (5, " ok"), (6, "\n")]
    stream += [(2, "</think>"), (7, "\n\n"), (8, "Yes"), (9, ".\n"), (None, "")]
    pieces, s = split(stream)
    assert pieces == [(REASONING, "Hmm"), (REASONING, " ok"), (ANSWER, "Yes"), (ANSWER, ".\n")]
    assert s.text == {REASONING: "Hmm ok", ANSWER: "Yes.\n"}
    assert s.tokens == {REASONING: 6, ANSWER: 3}


def test_splitter_whitespace_inside_reasoning_is_kept():
    pieces, _ = split([(1, ""), (3, "a"), (4, "\n\n"), (5, " "), (6, "b"), (7, "  ")])
    assert pieces == [(REASONING, "a"), (REASONING, "\n\n b")]


def test_a_prompt_that_opens_the_reasoning():
    pieces, s = split([(3, "\nHm"), (2, "</think>"), (4, "Yes")], prompt="Q<think>\n")
    assert pieces == [(REASONING, "Hm"), (ANSWER, "Yes")]
    _, s = split([(3, "x")], prompt="<think>\n\n</think>\n\n")
    assert s.text[ANSWER] == "x"
    # A <think> the user (or a system prompt) wrote opens nothing: only the prompt's end.
    asked = "<|im_start|>user\nWhat does the <think> tag do?<|im_end|>\n<|im_start|>assistant\n"
    pieces, s = split([(3, "It marks"), (4, " reasoning.")], prompt=asked)
    assert s.text == {REASONING: "", ANSWER: "It marks reasoning."}


def test_no_markers_pass_the_text_exactly():
    stream = [(1, "<think>"), (3, "  a\n"), (2, "</think>"), (None, " \n")]
    pieces, s = split(stream, markers=None)
    assert "".join(p for _, p in pieces) == "<think>  a\n</think> \n"
    assert s.tokens == {REASONING: 0, ANSWER: 3}


def test_text_held_back_before_a_marker_goes_to_the_part_before_it():
    pieces, _ = split([(1, ""), (3, "x"), (2, "y</think>"), (4, "z")])
    assert pieces == [(REASONING, "x"), (REASONING, "y"), (ANSWER, "z")]


def test_switches_only_where_the_template_reads_them():
    assert template_switches({"enable_thinking"}, False, None, None) == {"enable_thinking": False}
    # Granite 3.3's and DeepSeek V3.1's templates read `thinking`
    assert template_switches({"thinking", "messages"}, True, None, None) == {"thinking": True}
    assert template_switches({"reasoning_effort"}, None, "low", {"x": 1}) == {
        "x": 1,
        "reasoning_effort": "low",
    }
    with pytest.raises(UsageError, match="no switch for thinking .* drop --think/--no-think"):
        template_switches({"messages"}, True, None, None)
    with pytest.raises(UsageError, match="no reasoning effort"):
        template_switches({"enable_thinking"}, None, "high", None)
    with pytest.raises(UsageError, match="must be one of low, medium, high"):
        template_switches({"reasoning_effort"}, None, "max", None)


# ---- what a user sees ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return scripted_model_dir(tmp_path_factory.mktemp("thinker"), THINKS)


@pytest.fixture(scope="module")
def opener(tmp_path_factory):
    """A model whose template opens <think> in the prompt itself (as DeepSeek-R1's does)."""
    return scripted_model_dir(tmp_path_factory.mktemp("opener"), THINKS[1:], OPENS_THINK_TEMPLATE)


def test_run_in_a_pipe_prints_only_the_answer(thinker, opener):
    for model in (thinker, opener):
        r = llmrun("run", str(model), "Hi", "--temperature", "0")
        assert (r.returncode, r.stdout, r.stderr) == (0, "Lily was happy", "")
        r = llmrun("run", str(model), "Hi", "--temperature", "0", "--hide-thinking")
        assert r.stdout == "Lily was happy"


def test_run_show_thinking_in_a_pipe(thinker):
    r = llmrun("run", str(thinker), "Hi", "--temperature", "0", "--show-thinking")
    assert r.stdout == "Thinking...\nthe big\n...done thinking.\n\nLily was happy"


def test_run_json_has_reasoning_and_text_with_their_token_counts(thinker):
    r = llmrun("run", str(thinker), "Hi", "--temperature", "0", "--json")
    result = json.loads(r.stdout)
    assert (result["text"], result["reasoning"]) == ("Lily was happy", "the big")
    # <think> the big </think>; Lily was happy and the end-of-text token.
    assert (result["reasoning_tokens"], result["text_tokens"]) == (4, 4)
    assert result["completion_tokens"] == 8


def test_run_think_switches_through_the_template(thinker, opener):
    r = llmrun("run", str(thinker), "Hi", "--temperature", "0", "--no-think", "--show-prompt")
    assert r.stderr.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n\n")
    r = llmrun("run", str(opener), "Hi", "--no-think")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        "error: this model's chat template has no switch for thinking (it reads neither "
        "enable_thinking nor thinking): drop --think/--no-think\n"
    )
    r = llmrun("run", str(thinker), "Hi", "--reasoning-effort", "low")
    assert r.returncode == 2 and "has no reasoning effort" in r.stderr
    r = llmrun("run", str(thinker), "Hi", "--raw", "--think")
    assert r.returncode == 2 and "need the chat template: drop --raw" in r.stderr


def test_run_on_a_terminal_dims_the_reasoning(thinker):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "llmrun", "run", str(thinker), "Hi", "--temperature", "0"],
        env=dict(os.environ),
        encoding="utf-8",
        timeout=120,
    )
    child.expect(pexpect.EOF)
    dim, end = "\x1b[2m", "\x1b[0m"
    expected = (
        f"{dim}Thinking...{end}\r\n{dim}the{end}{dim} big{end}\r\n"
        f"{dim}...done thinking.{end}\r\n\r\n"
        "Lily was happy\r\n"
    )
    assert child.before.endswith(expected), repr(child.before)


def test_chat_keeps_reasoning_out_of_the_pipe_and_switches_it(thinker):
    r = llmrun("chat", str(thinker), "--temperature", "0", input="Hi\n/set think off\nHi\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Lily was happy\n\nLily was happy\n\n"
    assert "think = off" in r.stderr
    r = llmrun("chat", str(thinker), "--temperature", "0", "--show-thinking", input="Hi\n")
    assert r.stdout == "Thinking...\nthe big\n...done thinking.\n\nLily was happy\n\n"


def test_chat_session_keeps_the_reasoning_beside_the_answer(thinker):
    from llmrun import api
    from llmrun.chat import ChatSession

    engine = api.load(str(thinker))
    session = ChatSession(engine, engine.defaults.updated(temperature=0.0))
    pieces = list(session.send("Hi"))
    assert [(p.kind, str(p)) for p in pieces] == [
        (REASONING, "the"),
        (REASONING, " big"),
        (ANSWER, "Lily"),
        (ANSWER, " was"),
        (ANSWER, " happy"),
    ]
    assert session.messages[-1] == {
        "role": "assistant",
        "content": "Lily was happy",
        "reasoning_content": "the big",
    }
    session.set_param("think", "off")
    assert session.switches == {"enable_thinking": False}
    with pytest.raises(UsageError, match="think needs on or off"):
        session.set_param("think", "maybe")


@pytest.fixture(scope="module")
def thinking_server(thinker, tmp_path_factory):
    from serving import Server

    s = Server(tmp_path_factory.mktemp("serve"), str(thinker))
    yield s
    s.stop()


def test_serve_returns_reasoning_content_and_its_token_count(thinking_server, thinker):
    import openai

    client = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="-")
    messages = [{"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model=thinker.name, messages=messages, temperature=0)
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content) == ("Lily was happy", "the big")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4
    assert reply.usage.completion_tokens == 8

    stream = client.chat.completions.create(
        model=thinker.name,
        messages=messages,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    reasoning, content, usage = "", "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("the big", "Lily was happy")
    assert usage.completion_tokens_details.reasoning_tokens == 4


def test_serve_passes_template_switches_and_refuses_unknown_ones(thinking_server):
    import httpx

    url = f"{thinking_server.url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    r = httpx.post(url, json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Lily was happy"
    r = httpx.post(url, json={**body, "reasoning_effort": "low"})
    assert r.status_code == 400
    assert "has no reasoning effort" in r.json()["error"]["message"]
    history = body["messages"] + [
        {"role": "assistant", "content": "Lily was happy", "reasoning_content": "the big"},
        {"role": "user", "content": "Hi"},
    ]
    r = httpx.post(url, json={**body, "messages": history})
    assert r.status_code == 200


def test_a_harmony_tool_call_is_not_printed_as_the_answer(capsys):
    from llmrun import ui
    from llmrun.reasoning import COMMENTARY, Piece

    out = ui.ReplyWriter(show_reasoning=True)
    out.write(Piece(COMMENTARY, '<|channel|>commentary to=functions.f json<|message|>{"a": 1}'))
    out.write(Piece(ANSWER, "Done."))
    out.end()
    assert capsys.readouterr().out == "Done."


def test_a_format_applies_after_the_reasoning_the_prompt_opened(opener, tmp_path):
    """The prompt opens <think>: the model reasons, then writes the JSON as its answer
    (before, the grammar held from the first token, so the JSON was written inside the
    reasoning and the answer was empty). `run` and `run --batch` alike."""
    schema = tmp_path / "schema.json"
    boolean = {"type": "boolean"}
    schema.write_text(
        json.dumps({"type": "object", "properties": {"a": boolean}, "required": ["a"]})
    )
    flags = ("--temperature", "0", "-n", "30", "--format", str(schema))
    r = llmrun("run", str(opener), "Hi", *flags, "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["reasoning"] == "the big"
    assert set(json.loads(result["text"])) == {"a"}
    r = llmrun("run", str(opener), "--batch", "-", "--batch-lines", *flags, input="Hi\n")
    record = json.loads(r.stdout)
    assert (record["reasoning"], record["text"]) == ("the big", result["text"])


class ListVocab:
    def __init__(self, tokens):
        self.tokens = tokens

    def token_id(self, text):
        return self.tokens.index(text) if text in self.tokens else None


@pytest.mark.parametrize(
    ("opener", "closer"),
    [("<seed:think>", "</seed:think>"), ("<|START_THINKING|>", "<|END_THINKING|>")],
)
def test_seed_oss_and_command_reasoning_markers(opener, closer):
    """Seed-OSS's and Command A / R7B's reasoning is told from the answer (it came out
    as the answer), as llama.cpp's and vLLM's reasoning parsers read it."""
    markers = find_markers(ListVocab(["x", opener, closer]))
    assert markers == Markers(1, 2, opener, closer)
    pieces, s = split([(1, opener), (3, "Hm"), (2, closer), (4, "Yes")], markers=markers)
    assert s.text == {REASONING: "Hm", ANSWER: "Yes"}
    _, s = split([(3, "Hm"), (2, closer), (4, "Yes")], prompt=f"Q{opener}", markers=markers)
    assert s.text == {REASONING: "Hm", ANSWER: "Yes"}
    # Where a vocabulary has <think> too, it is the one.
    assert find_markers(ListVocab([opener, closer, "<think>", "</think>"])) == Markers(2, 3)


def test_gemma4_channel_markers():
    """Gemma 4 thinks in a `thought` channel: `<|channel>thought\\n...<channel|>`, its
    name part of neither reasoning nor answer (as llama.cpp's Gemma 4 parser reads it);
    the template's prompt without thinking holds an empty channel, so all is answer."""
    markers = find_markers(ListVocab(["x", "<|channel>", "<channel|>"]))
    assert markers == Markers(1, 2, "<|channel>", "<channel|>", "thought")
    stream = [(1, "<|channel>"), (3, "thought"), (4, "\nHm,"), (5, " four."), (2, "<channel|>")]
    pieces, s = split([*stream, (6, "4")], prompt="<|turn>model\n", markers=markers)
    assert s.text == {REASONING: "Hm, four.", ANSWER: "4"}
    # The name cut into pieces, or not written at all.
    stream = [(1, ""), (3, "tho"), (4, "ught\nHm"), (2, ""), (6, "4")]
    assert split(stream, markers=markers)[1].text == {REASONING: "Hm", ANSWER: "4"}
    assert split([(1, ""), (3, "Hm"), (2, "")], markers=markers)[1].text[REASONING] == "Hm"
    empty = "<|turn>model\n<|channel>thought\n<channel|>"
    assert split([(6, "4")], prompt=empty, markers=markers)[1].text == {REASONING: "", ANSWER: "4"}
    opened = "<|turn>model\n<|channel>thought\n"
    assert split([(3, "Hm"), (2, ""), (6, "4")], prompt=opened, markers=markers)[1].text == {
        REASONING: "Hm",
        ANSWER: "4",
    }
