"""Chat sessions: template use, KV prefix reuse, history commands, context limits."""

import json

import pytest
import torch
from helpers import TEMPLATES_MISSING, chat_model_dir

from llmrun import api
from llmrun.chat import ChatSession, Turn
from llmrun.chat_template import plain_transcript
from llmrun.errors import ContextOverflowError, LlmrunError, TemplateError, UsageError
from llmrun.generate import KVState, prefill, reuse_prefix
from llmrun.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if TEMPLATES_MISSING:
        pytest.skip(TEMPLATES_MISSING)
    return api.load(str(chat_model_dir(tmp_path_factory.mktemp("chat") / "m")), device="cpu")


@pytest.fixture(scope="module")
def stories():
    return api.load(None, device="cpu")


def reply(session: ChatSession, text: str) -> Turn:
    turn = Turn()
    for _ in session.send(text, turn):
        pass
    return turn


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_prefill(engine):
    session = ChatSession(engine, GREEDY, max_tokens=6, system="Be brief.")
    first = reply(session, "Hello there")
    assert first.response.stats.prompt_processed == first.response.stats.prompt_tokens
    cached = list(session.state.tokens)

    second = reply(session, "Tell me a story")
    stats = second.response.stats
    assert stats.prompt_processed < stats.prompt_tokens / 2

    # The logits after reusing the cached prefix equal those of a fresh prefill of the
    # whole conversation (1e-5: only the chunking of the arithmetic differs).
    session.messages.append({"role": "user", "content": "And then?"})
    prompt = session.prompt_ids(session.conversation())
    reused = KVState(session.state.cache, cached + [t for t in session.state.tokens[len(cached) :]])
    kept = reuse_prefix(reused, prompt)
    assert kept > len(cached)
    with torch.no_grad():
        incremental = prefill(engine.model, reused, prompt[kept:])
        fresh = prefill(engine.model, engine.new_state(), prompt)
    torch.testing.assert_close(incremental, fresh, atol=1e-5, rtol=0)


def test_template_is_applied_and_history_kept(engine):
    session = ChatSession(engine, GREEDY, max_tokens=4)
    reply(session, "Hi")
    reply(session, "Again")
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    text = engine.tokenizer.decode(session.prompt_ids(session.conversation()), skip_special=False)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert "<|im_start|>user\nAgain<|im_end|>" in text


def test_undo_retry_clear(engine):
    session = ChatSession(engine, GREEDY, max_tokens=4)
    reply(session, "One")
    reply(session, "Two")
    two = session.context_used
    session.undo()
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["One"]
    # What the history holds now, not what the cache last held.
    assert session.context_used == len(session.prompt_ids(session.conversation())) < two
    before = session.messages[-1]["content"]
    turn = Turn()
    assert "".join(session.retry(turn)) == before  # greedy: the same reply again
    assert len(session.messages) == 2
    session.clear()
    assert session.messages == [] and session.context_used == 0
    with pytest.raises(UsageError):
        session.undo()
    with pytest.raises(UsageError):
        session.retry()


def test_set_param(engine):
    session = ChatSession(engine, GREEDY)
    session.set_param("temperature", "0.5")
    session.set_param("top_k", "7")
    session.set_param("max_tokens", "12")
    assert (
        session.params.temperature == 0.5 and session.params.top_k == 7 and session.max_tokens == 12
    )
    with pytest.raises(UsageError, match="unknown parameter"):
        session.set_param("warmth", "1")
    with pytest.raises(UsageError, match="top_k needs an integer, got 'many'"):
        session.set_param("top_k", "many")
    with pytest.raises(UsageError, match="temperature needs a number, got 'warm'"):
        session.set_param("temperature", "warm")


def test_set_minus_one_means_what_the_flags_mean(stories):
    """-1 is --seed's random seed and --max-tokens' no limit; below it, max_tokens is
    refused as -n refuses it (it was taken as no limit, and seed -1 as a fixed seed)."""
    session = ChatSession(stories, SamplingParams(seed=7), max_tokens=5)
    session.set_param("seed", "-1")
    assert session.params.seed is None
    session.set_param("max_tokens", "-1")
    assert session.max_tokens is None
    session.set_param("max_tokens", "3")
    with pytest.raises(UsageError, match=r"max_tokens must be >= -1 \(-1: no limit\), got -7"):
        session.set_param("max_tokens", "-7")
    assert session.max_tokens == 3


def test_save_and_load(engine, tmp_path):
    session = ChatSession(engine, GREEDY, max_tokens=3, system="S")
    reply(session, "Héllo 👋")
    session.save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["system"] == "S" and data["messages"][0]["content"] == "Héllo 👋"
    other = ChatSession(engine, GREEDY)
    other.load(tmp_path / "c.json")
    assert other.messages == session.messages and other.system == "S"
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "wizard"}]}')
    with pytest.raises(Exception, match="not a saved conversation"):
        other.load(tmp_path / "bad.json")
    # Not UTF-8, or a system prompt that is no text: errors, the session as it was.
    (tmp_path / "binary.json").write_bytes(b"\xd0\xff\x00")
    (tmp_path / "system.json").write_text('{"system": 5, "messages": []}')
    for bad in ("binary.json", "system.json"):
        with pytest.raises(LlmrunError, match="not a saved conversation"):
            other.load(tmp_path / bad)
    assert other.messages == session.messages and other.system == "S"


def test_a_turn_the_template_refuses_leaves_no_trace(engine):
    """A template that raises on the conversation (Mistral's and Gemma's want roles
    to alternate) refuses the turn; the user message must not stay, or every later
    turn fails the same way."""
    session = ChatSession(engine, GREEDY, max_tokens=3)
    reply(session, "Hi")
    before = list(session.messages)
    session.prompt_text = lambda conversation: (_ for _ in ()).throw(TemplateError("no"))
    with pytest.raises(TemplateError):
        reply(session, "Hi again")
    assert session.messages == before


def test_a_ctrl_c_before_the_reply_begins_leaves_no_trace(engine):
    """Ctrl-C while the conversation is rendered and encoded: the message goes, as if
    never sent (it stayed without a reply, so templates that want roles in alternation
    refused every later turn)."""
    session = ChatSession(engine, GREEDY, max_tokens=3)
    reply(session, "Hi")
    before = list(session.messages)

    def interrupted(conversation):
        raise KeyboardInterrupt

    session.prompt_text = interrupted
    with pytest.raises(KeyboardInterrupt):
        reply(session, "Hi again")
    assert session.messages == before
    del session.prompt_text  # the next turn goes on from the history as it was
    reply(session, "Hi again")
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2


@pytest.mark.parametrize("tokens_first", [0, 2])
def test_a_ctrl_c_in_the_prefill_leaves_no_trace_and_after_a_token_keeps_the_reply(
    engine, monkeypatch, tokens_first
):
    """Ctrl-C while the prompt is prefilled (no token yet): the message goes, with no
    empty reply (one was kept); after the first tokens the reply so far is kept."""
    session = ChatSession(engine, GREEDY, max_tokens=3)
    reply(session, "Hi")
    before = list(session.messages)
    generate = engine.generate

    def interrupted(*args, **kwargs):
        for i, response in enumerate(generate(*args, **kwargs)):
            if i == tokens_first:
                raise KeyboardInterrupt
            yield response

    monkeypatch.setattr(engine, "generate", interrupted)
    turn = reply(session, "Hi again")
    assert turn.interrupted and turn.withdrawn == (tokens_first == 0)
    if tokens_first == 0:
        assert session.messages == before
    else:
        assert session.messages[:-1] == [*before, {"role": "user", "content": "Hi again"}]
        assert session.messages[-1] == {"role": "assistant", "content": turn.text} and turn.text


def test_context_overflow_error_and_shift(stories):
    small = stories.new_state(64)
    session = ChatSession(stories, GREEDY, max_tokens=8, state=small)
    reply(session, "Once upon a time there was a cat")
    with pytest.raises(ContextOverflowError, match="/clear"):
        reply(session, "The cat had a big red ball and a little dog " * 2)
    assert session.messages[-1]["role"] == "assistant"  # the refused message is not kept

    shifting = ChatSession(
        stories,
        GREEDY,
        max_tokens=8,
        system="Tell stories.",
        overflow="shift",
        state=stories.new_state(64),
    )
    reply(shifting, "Once upon a time there was a cat")
    turn = reply(shifting, "The cat had a big red ball and a little dog")
    assert turn.dropped == 2
    assert shifting.conversation()[0] == {"role": "system", "content": "Tell stories."}
    assert shifting.messages[0]["content"].startswith("The cat had")


def test_a_message_longer_than_the_context_says_to_shorten_it(stories):
    """/clear and --context-overflow shift cannot make room for a message that alone
    does not fit: the error says so, and the session goes on as it was."""
    for overflow in ("error", "shift"):
        session = ChatSession(
            stories, GREEDY, max_tokens=8, overflow=overflow, state=stories.new_state(64)
        )
        reply(session, "Once upon a time")
        before = list(session.messages)
        long = "The cat had a big red ball and a little dog " * 5
        with pytest.raises(ContextOverflowError) as refused:
            reply(session, long)
        needed = len(
            stories.tokenizer.encode(plain_transcript([{"role": "user", "content": long}]))
        )
        assert str(refused.value) == (
            f"the message needs {needed} tokens plus room for a reply, but the context holds "
            "64: shorten it, or use a larger --ctx-size"
        )
        assert session.messages == before
        assert reply(session, "The end").text


def test_model_without_template_uses_a_plain_transcript(stories):
    session = ChatSession(stories, GREEDY, max_tokens=30)
    turn = reply(session, "Tell me about Lily.")
    text = stories.tokenizer.decode(session.prompt_ids(session.conversation()))
    assert text.startswith("User: Tell me about Lily.\nAssistant:")
    assert "\nUser:" not in turn.text  # the plain transcript's turn marker stops the reply
