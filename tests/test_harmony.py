"""gpt-oss's harmony messages told apart (llmrun/reasoning.py): the splitter on exact token
streams, and what `run`, `chat` and `serve` show with scripted models whose vocabulary has
harmony's tokens (tests/scripted.py), through gpt-oss's own chat template and through one
that opens the analysis channel in the prompt.

A scripted model says each token of its script once, so one reply holds at most one
<|channel|> and one <|message|>: the real template's replies are one message; a reply of
reasoning and answer comes from a template that opens the analysis channel itself."""

from __future__ import annotations

import json

import pytest
from helpers import TEMPLATES_DIR, needs_templates
from in_process import llmrun
from scripted import scripted_model_dir

from llmrun.reasoning import (
    ANSWER,
    COMMENTARY,
    HARMONY_TOKENS,
    REASONING,
    Harmony,
    Markers,
    Splitter,
    find_markers,
)

H = Harmony(start=1, channel=2, message=3, end=4, return_=5, call=6)
PROMPT = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
CONSTRAIN = 7


def split(stream, prompt=PROMPT):
    s = Splitter(H, prompt)
    return [(p.kind, str(p)) for token, text in stream for p in s.feed(token, text)], s


# How `run` sees the special tokens (their text skipped) and how serve's tool-call reader
# sees them (their text given back).
SKIPPED = {1: "", 2: "", 3: "", 4: "", 5: "", 6: "", CONSTRAIN: ""}
GIVEN = {1: "<|start|>", 2: "<|channel|>", 3: "<|message|>", 4: "<|end|>", 5: "<|return|>"}
GIVEN |= {6: "<|call|>", CONSTRAIN: "<|constrain|>"}


def stream_of(tokens: list, texts: dict) -> list[tuple[int, str]]:
    """(id, text) pairs: an int is a harmony token, a string a word (ids from 10 up)."""
    return [(t, texts[t]) if isinstance(t, int) else (10 + i, t) for i, t in enumerate(tokens)]


ANALYSIS_THEN_FINAL = [2, "analysis", 3, "The user ", "greets.", "\n", 4]
ANALYSIS_THEN_FINAL += [1, "assistant", 2, "final", 3, "\n", "Hello", "!", 5]


@pytest.mark.parametrize("texts", [SKIPPED, GIVEN], ids=["skipped", "given"])
def test_analysis_is_reasoning_and_final_the_answer(texts):
    pieces, s = split(stream_of(ANALYSIS_THEN_FINAL, texts))
    assert pieces == [
        (REASONING, "The user"),
        (REASONING, " greets."),
        (ANSWER, "Hello"),
        (ANSWER, "!"),
    ]
    assert s.text == {REASONING: "The user greets.", ANSWER: "Hello!", COMMENTARY: ""}
    # Each message's tokens with it, its header and end marker included.
    assert s.tokens == {REASONING: 7, ANSWER: 9, COMMENTARY: 0}


def test_a_call_on_the_commentary_channel_is_kept_as_written():
    tokens = [2, "analysis", 3, "Weather.", 4, 1, "assistant", 2]
    tokens += ["commentary to=functions.get_weather ", CONSTRAIN, "json", 3, '{"city": "Paris"}', 6]
    pieces, s = split(stream_of(tokens, GIVEN))
    call = (
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    assert pieces[0] == (REASONING, "Weather.")
    assert all(kind == COMMENTARY for kind, _ in pieces[1:])
    assert "".join(text for _, text in pieces[1:]) == s.text[COMMENTARY] == call
    assert s.text[ANSWER] == "" and s.tokens[COMMENTARY] == 9
    # A recipient makes a call whatever the channel, and the commentary channel is
    # commentary without one (a preamble); as fed, so with `run`'s skipped marker text.
    pieces, _ = split(stream_of([2, "analysis to=browser.search", 3, "{}", 6], SKIPPED))
    assert pieces == [(COMMENTARY, "analysis to=browser.search"), (COMMENTARY, "{}")]
    pieces, _ = split(stream_of([2, "commentary", 3, "Checking.", 4], SKIPPED))
    assert pieces == [(COMMENTARY, "commentary"), (COMMENTARY, "Checking.")]


def test_messages_of_reasoning_are_a_line_apart():
    tokens = [2, "analysis", 3, "One.", 4, 1, "assistant", 2, "analysis", 3, "Two.", 4]
    tokens += [1, "assistant", 2, "final", 3, "Yes", 5]
    pieces, s = split(stream_of(tokens, SKIPPED))
    assert s.text[REASONING] == "One.\nTwo." and s.text[ANSWER] == "Yes"


def test_where_the_prompt_leaves_the_reply():
    # In the analysis channel's body (a template that opens it).
    opened = PROMPT + "<|channel|>analysis<|message|>"
    pieces, _ = split(stream_of(["Hm", 4, 1, "assistant", 2, "final", 3, "Ok", 5], SKIPPED), opened)
    assert pieces == [(REASONING, "Hm"), (ANSWER, "Ok")]
    # After a finished message, or with no harmony at all (--raw): text is the answer.
    for prompt in (PROMPT + "<|channel|>final<|message|>Hi<|end|>", "Once upon a time"):
        pieces, _ = split([(10, " there"), (11, " was")], prompt)
        assert pieces == [(ANSWER, " there"), (ANSWER, " was")]
    # A <|channel|> outside any message opens a header, as <|start|> does.
    pieces, _ = split(stream_of([2, "analysis", 3, "A", 4, 2, "final", 3, "B", 5], SKIPPED))
    assert pieces == [(REASONING, "A"), (ANSWER, "B")]


def test_a_reply_without_a_header_is_the_answer():
    """A model that writes no header after the prompt's `<|start|>assistant` (one that
    ignores the format, a random test model) has its text shown as the answer, from the
    token that shows it is no header; a header cut anywhere still waits."""
    pieces, s = split([(10, " t"), (11, "he"), (12, " end")])
    assert pieces == [(ANSWER, " the"), (ANSWER, " end")]
    assert s.tokens[ANSWER] == 3
    pieces, _ = split([(10, " t"), (11, "o=user"), (3, ""), (12, "Hi"), (5, "")])
    assert pieces == [(ANSWER, "Hi")]


class Vocab:
    def __init__(self, tokens):
        self.ids = {t: i for i, t in enumerate(tokens)}

    def token_id(self, text):
        return self.ids.get(text)


def test_markers_are_found_in_the_vocabulary():
    assert find_markers(Vocab(HARMONY_TOKENS)) == Harmony(0, 1, 2, 3, 4, 5)
    assert find_markers(Vocab(HARMONY_TOKENS[:4])) == Harmony(0, 1, 2, 3)
    assert find_markers(Vocab(["<|start|>", "<|channel|>", "<|end|>"])) is None
    both = Vocab([*HARMONY_TOKENS, "<think>", "</think>"])
    assert find_markers(both) == Harmony(0, 1, 2, 3, 4, 5)
    assert find_markers(Vocab(["<|start|>", "<think>", "</think>"])) == Markers(1, 2)


# ---- what a user sees ----------------------------------------------------------------------

HARMONY = [(t, True) for t in (*HARMONY_TOKENS, "<|constrain|>")]
WORDS = [(w, False) for w in ("assistant", "analysis", "final", "Well", "Lily")]
# A template in harmony's form that opens the analysis channel in the prompt (and begins
# it, so that the reply's first token is not the prompt's last).
OPENS_ANALYSIS = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>Well"
    "{% endif %}"
)
THINKS = ["▁the", "▁big", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final"]
THINKS += ["<|message|>", "▁Lily", "▁was", "▁happy", "<|return|>"]
GPT_OSS_TEMPLATE = "openai-gpt-oss-120b.jinja"


def harmony_model(path, script, template):
    return scripted_model_dir(
        path, script, template, tokens=[*HARMONY, *WORDS], eos=["<|return|>", "<|call|>"]
    )


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return harmony_model(tmp_path_factory.mktemp("harmony"), THINKS, OPENS_ANALYSIS)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """gpt-oss's own template; the reply is one final message."""
    if not (TEMPLATES_DIR / GPT_OSS_TEMPLATE).is_file():
        pytest.skip(f"no {GPT_OSS_TEMPLATE}: run python tests/data/fetch.py")
    template = (TEMPLATES_DIR / GPT_OSS_TEMPLATE).read_text()
    # "Lily", not "▁Lily": an answer without reasoning passes as generated, space and all.
    script = ["<|channel|>", "final", "<|message|>", "Lily", "▁was", "▁happy", "<|return|>"]
    return harmony_model(tmp_path_factory.mktemp("gpt-oss"), script, template)


def test_run_shows_the_analysis_apart(thinker):
    r = llmrun("run", str(thinker), "Hi", "--temperature", "0")
    assert (r.returncode, r.stdout, r.stderr) == (0, "Lily was happy", "")
    r = llmrun("run", str(thinker), "Hi", "--temperature", "0", "--show-thinking")
    assert r.stdout == "Thinking...\nthe big\n...done thinking.\n\nLily was happy"
    result = json.loads(llmrun("run", str(thinker), "Hi", "--temperature", "0", "--json").stdout)
    assert (result["text"], result["reasoning"]) == ("Lily was happy", "the big")
    # the big <|end|>; <|start|> assistant <|channel|> final <|message|> Lily was happy <|return|>
    assert (result["reasoning_tokens"], result["text_tokens"]) == (3, 9)


@needs_templates
def test_gpt_oss_template_final_message_and_reasoning_effort(gpt_oss):
    r = llmrun("run", str(gpt_oss), "Hi", "--temperature", "0")
    assert (r.returncode, r.stdout) == (0, "Lily was happy"), r.stderr
    r = llmrun("run", str(gpt_oss), "Hi", "-n", "1", "--reasoning-effort", "low", "--show-prompt")
    assert r.returncode == 0 and "Reasoning: low" in r.stderr
    assert r.stderr.rstrip("\n").endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    result = json.loads(llmrun("run", str(gpt_oss), "Hi", "--temperature", "0", "--json").stdout)
    assert (result["text"], result["reasoning"], result["reasoning_tokens"]) == (
        "Lily was happy",
        "",
        0,
    )


def test_chat_keeps_the_analysis_beside_the_answer(thinker):
    r = llmrun("chat", str(thinker), "--temperature", "0", input="Hi\nHi\n")
    assert (r.returncode, r.stdout) == (0, "Lily was happy\n\nLily was happy\n\n"), r.stderr
    from llmrun import api
    from llmrun.chat import ChatSession

    engine = api.load(str(thinker))
    assert isinstance(engine.markers, Harmony)
    session = ChatSession(engine, engine.defaults.updated(temperature=0.0))
    assert "".join(session.send("Hi")) == "the bigLily was happy"
    assert session.messages[-1] == {
        "role": "assistant",
        "content": "Lily was happy",
        "reasoning_content": "the big",
    }


def test_serve_returns_the_analysis_as_reasoning_content(thinker, tmp_path):
    import openai
    from serving import Server

    server = Server(tmp_path, str(thinker))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
        reply = client.chat.completions.create(
            model=thinker.name, messages=[{"role": "user", "content": "Hi"}], temperature=0
        )
        message = reply.choices[0].message
        assert (message.content, message.reasoning_content) == ("Lily was happy", "the big")
        assert reply.usage.completion_tokens_details.reasoning_tokens == 3
    finally:
        server.stop()
