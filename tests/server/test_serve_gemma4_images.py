"""serve with images for Gemma 4, on a tiny random Gemma4ForConditionalGeneration
(gemma4_vision_helpers): images of other sizes take other numbers of soft tokens, which
see each other both ways on the sliding layer. A greedy chat completion with two images
equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other sizes batched with each other and with a
text-only request, in prefill chunks that would split an image, each get their reply
alone; the prefix cache reuses an image's blocks for the same image only.

Tolerances: tokens and text exact.
"""

import pytest
from gemma4_vision_helpers import (
    greedy_tokens,
    processor_inputs,
    save_gemma4_vl_dir,
    tiny_gemma4_vl,
)
from helpers import needs_templates
from serving import GREEDY, alone, chat_reply, image_prompt, scheduled
from starlette.testclient import TestClient
from vision_helpers import picture

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE
from llmrun.server import Service, create_app

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
pytestmark = needs_templates
QUESTION = "What is in these pictures?"
# Resized to fill 70 tokens of 3x3 patches of 4 pixels whatever their size: 6x10 and
# 10x6 tokens, and 3x18 of a long strip.
WIDE, TALL, STRIP = picture(48, 80, 1), picture(100, 60, 2), picture(24, 120, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma4_vl_dir(model, tmp_path_factory.mktemp("gemma4-vl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    service = Service("gemma4", set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_a_greedy_reply_to_two_images_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, TALL, QUESTION)
    text, tokens = alone(engine, WIDE, TALL, QUESTION)
    _, ids, _, _ = image_prompt(engine, WIDE, TALL, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE), open_image(TALL)], QUESTION)
    assert ids == reference.input_ids[0].tolist()
    assert tokens == greedy_tokens(model, reference)
    # The template closes an empty thought; the answer after it is sent without its
    # leading space (llmrun.reasoning).
    assert reply["choices"][0]["message"]["content"] == text.lstrip()
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["usage"]["completion_tokens"] == len(tokens)


def image_request(engine, *parts) -> Request:
    _, ids, prompt_images, digests = image_prompt(engine, *parts)
    return Request(ids, GREEDY, 8, images=prompt_images, image_digests=digests)


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    wide, strip = ("Look here", WIDE, "What is it?"), ("Look here", STRIP, "What is it?")
    lengths = []
    for parts in (wide, strip):
        _, _, prompt_images, _ = image_prompt(engine, *parts)
        ((start, end),) = prompt_images.spans()
        assert start % 8 and end - start > 8  # chunks of 8 would split it
        lengths.append(end - start)
    assert lengths == [60, 54]
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = [image_request(engine, *wide), image_request(engine, *strip)]
    requests.append(Request(text_only, GREEDY, 8))
    got = scheduled(Scheduler(engine, parallel=3, prefill_budget=8), requests)
    assert got[0] == alone(engine, *wide)
    assert got[1] == alone(engine, *strip)
    assert got[2][0] == "".join(r.text for r in engine.generate(text_only, GREEDY, 8))


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    def cached(reply):
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    ((start, end),) = image_prompt(engine, TALL, QUESTION)[2].spans()
    first = chat_reply(client, TALL, QUESTION)
    again = chat_reply(client, TALL, QUESTION)
    assert cached(again) == BLOCK_SIZE * (first["usage"]["prompt_tokens"] // BLOCK_SIZE)
    assert cached(again) > end and again["choices"] == first["choices"]
    # Another image of the same size at the same place: no block from its start on.
    other = (picture(100, 60, 4), QUESTION)
    reply = chat_reply(client, *other)
    assert cached(reply) == start // BLOCK_SIZE * BLOCK_SIZE
    assert reply["choices"][0]["message"]["content"] == alone(engine, *other)[0]
