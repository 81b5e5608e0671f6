"""Checks each image family's serve test (tests/server/test_serve_*images.py) holds its
own tiny model to: serve's greedy reply to an image is `llmrun run --image`'s and
transformers'; requests with different images batched with a text-only one, in prefill
chunks that would split an image, each get their reply alone; the prefix cache reuses an
image's blocks for the same image only; images over the context are a 400 before they
are encoded; `llmrun serve` in a process takes images. Each takes the family's engine,
prompts and reference; only the code is shared. Their asserts say what they compared
(pytest rewrites the asserts of test modules only).

Tolerances: tokens and text exact.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from serving import (
    GREEDY,
    Server,
    alone,
    chat_reply,
    image_content,
    image_prompt,
    image_request,
    scheduled,
)

from llmrun.batching import Request, Scheduler
from llmrun.kv_blocks import BLOCK_SIZE


def check_reply_is_run_s(
    reply: dict,
    engine,
    parts: Sequence,
    reference: list[int],
    prompt_tokens: int,
    whole: bool = False,
    lstrip: bool = False,
) -> None:
    """serve's greedy `reply` (8 tokens at most) to a user message of `parts` is the
    single-sequence loop's (`llmrun run --image`), whose tokens are transformers'
    `reference`: all of them where `whole`, else their first (at least 4: run stops at an
    EOS transformers' generate runs past). Its usage counts `prompt_tokens` (the image's
    among them) and the tokens sent. `lstrip`: the reply is run's text without its leading
    space (an answer after a closed thought: llmrun.reasoning)."""
    text, tokens = alone(engine, *parts)
    if whole:
        assert tokens == reference, (tokens, reference)
    else:
        assert tokens == reference[: len(tokens)] and len(tokens) >= 4, (tokens, reference)
    content = reply["choices"][0]["message"]["content"]
    assert content == (text.lstrip() if lstrip else text), (content, text)
    usage = reply["usage"]
    assert usage["prompt_tokens"] == prompt_tokens, (usage, prompt_tokens)
    assert usage["completion_tokens"] == len(tokens), (usage, tokens)


def check_batched_replies_are_alone_s(
    engine, first: Sequence, second: Sequence, prefill_budget: int
) -> None:
    """Requests of `first` and `second` (messages with different images) and a text-only
    one, decoded together in prefill chunks of `prefill_budget` tokens, each get the
    single-sequence loop's reply; the two image requests' differ (each saw its own)."""
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = [image_request(engine, *first), image_request(engine, *second)]
    requests.append(Request(text_only, GREEDY, 8))
    got = scheduled(Scheduler(engine, parallel=3, prefill_budget=prefill_budget), requests)
    expected = [alone(engine, *first), alone(engine, *second)]
    assert got[:2] == expected, (got, expected)
    assert got[0] != got[1], got
    text = "".join(r.text for r in engine.generate(text_only, GREEDY, 8))
    assert got[2][0] == text, (got[2], text)


def check_other_shifts_after_the_images(engine, first: Sequence, second: Sequence) -> None:
    """`first` and `second` (a message with one image each, M-RoPE's) put their images
    where chunks of 8 tokens would split them, with more than 8 tokens of text after them,
    which turn by other shifts (one before its place at least)."""
    shifts = []
    for parts in (first, second):
        _, ids, prompt_images, _ = image_prompt(engine, *parts)
        ((start, end),) = prompt_images.spans()
        # chunks of text after it
        assert start % 8 and end % 8 and len(ids) - end > 8, (start, end, len(ids))
        shifts.append(prompt_images.shift_at(len(ids)))
    assert shifts[0] != shifts[1] and min(shifts) < 0, shifts


@dataclass
class Reused:
    """The prompt tokens the prefix cache reused (usage's cached_tokens) for a message
    sent again, with another question after its image, and with another image."""

    again: int
    other_question: int | None
    other_image: int


def check_prefix_cache_reuses_an_image_only_for_the_same_image(
    client, engine, parts: Sequence, other_image: bytes, other_question: str | None = None
) -> Reused:
    """`parts` (one image, a question last) sent twice: the second reuses the whole blocks
    of its prompt but the last token (fed again for its logits) and replies alike. With
    `other_question` in place of the question: the reused prefix ends inside the image
    (past the first block boundary in it), its rest is fed, and the reply is run's. With
    `other_image` (of the image's size) in its place (and `other_question`, if given): no
    block from the image's start on is reused, and the reply is run's."""

    def cached(reply: dict) -> int:
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    def check_alone_s(reply: dict, *asked) -> None:
        content, text = reply["choices"][0]["message"]["content"], alone(engine, *asked)[0]
        assert content == text, (content, text)

    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    first = chat_reply(client, *parts)
    again = chat_reply(client, *parts)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert cached(again) == BLOCK_SIZE * ((prompt_tokens - 1) // BLOCK_SIZE), again["usage"]
    assert again["choices"] == first["choices"], (again, first)
    reused_with_other_question = None
    question = parts[-1]
    if other_question is not None:
        question = other_question
        asked = (*parts[:-1], other_question)
        reply = chat_reply(client, *asked)
        reused_with_other_question = cached(reply)
        inside = (start // BLOCK_SIZE + 1) * BLOCK_SIZE  # the first block end in the image
        assert inside <= reused_with_other_question < end, (start, end, reply["usage"])
        check_alone_s(reply, *asked)
    shown = (*(other_image if isinstance(p, bytes) else p for p in parts[:-1]), question)
    reply = chat_reply(client, *shown)
    assert cached(reply) == start // BLOCK_SIZE * BLOCK_SIZE, (start, reply["usage"])
    check_alone_s(reply, *shown)
    return Reused(cached(again), reused_with_other_question, cached(reply))


def check_images_over_the_context_are_400_before_encoding(
    client, engine, images: list[bytes], tokens: int, context: int
) -> None:
    """A message of `images`, which take `tokens` tokens where the engine's context is
    `context`, is a 400 context_length_exceeded on the last image; the images before it
    are encoded, it is not."""
    assert engine.ctx_size == context
    encoded = []
    encode_images = engine.encode_images

    def counted(pictures):
        encoded.extend(pictures)
        return encode_images(pictures)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "encode_images", counted)
        body = {"messages": [{"role": "user", "content": image_content(*images)}]}
        response = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert error["param"] == f"messages.0.content.{len(images) - 1}.image_url.url", error
    assert f"take {tokens} tokens, more than the context of {context}" in error["message"], error
    assert len(encoded) == len(images) - 1, len(encoded)


def served_process_reply(tmp_path: Path, args: Sequence[str], *parts) -> str:
    """`llmrun serve ARGS` in a process, which says it takes images: its greedy reply (8
    tokens at most) to a user message of `parts`."""
    server = Server(tmp_path, *args)
    try:
        assert "takes images" in server.log.read_text(), server.log.read_text()
        body = {"messages": [{"role": "user", "content": image_content(*parts)}]}
        body.update(temperature=0, max_tokens=8)
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.stop()
    return reply["choices"][0]["message"]["content"]
