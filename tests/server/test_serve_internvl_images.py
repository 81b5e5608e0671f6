"""serve with images for InternVL, on a tiny random InternVLForConditionalGeneration
(internvl_helpers), whose images take a number of 64-pixel tiles by their size and shape
(a thumbnail after several), 16 tokens a tile between <img> and </img>. A greedy chat
completion with an image equals `llmrun run --image`'s tokens (the engine's single-sequence
loop) and transformers'; requests with images of other tile counts batched together (in
prefill chunks that would split an image) each get their reply alone; the prefix cache
reuses an image's blocks for the same image only; images over the context are a 400 before
they are encoded.

Tolerances: tokens and text exact.
"""

import pytest
from internvl_helpers import greedy_tokens, processor_inputs, save_internvl_dir, tiny_internvl
from serving import GREEDY, alone, chat_reply, image_content, image_prompt, scheduled
from starlette.testclient import TestClient
from vision_helpers import picture

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE
from llmrun.server import Service, create_app

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 48x150: 3 tiles in a row and a thumbnail (66 tokens with <img> and </img>); 100x60: 2
# tiles in a column and a thumbnail (50); 64x64: one tile (18).
WIDE, TALL, SQUARE = picture(48, 150, 1), picture(100, 60, 2), picture(64, 64, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_internvl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_internvl_dir(model, tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    service = Service("internvl", set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    text, tokens = alone(engine, WIDE, QUESTION)
    expected = greedy_tokens(model, processor_inputs(folder, [open_image(WIDE)], QUESTION))
    assert tokens == expected[: len(tokens)] and len(tokens) >= 4  # run stops at EOS
    assert reply["choices"][0]["message"]["content"] == text
    reference = processor_inputs(folder, [open_image(WIDE)], QUESTION)
    assert reply["usage"]["prompt_tokens"] == reference["input_ids"].shape[1]
    assert reply["usage"]["completion_tokens"] == len(tokens)


def test_images_of_other_tile_counts_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [b - a for ((a, b),) in spans] == [64, 48]
    assert all(a < 16 < b for ((a, b),) in spans)
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = []
    for parts in (wide, tall):
        _, ids, prompt_images, digests = image_prompt(engine, *parts)
        requests.append(Request(ids, GREEDY, 8, images=prompt_images, image_digests=digests))
    requests.append(Request(text_only, GREEDY, 8))
    got = scheduled(Scheduler(engine, parallel=3, prefill_budget=16), requests)
    assert got[0] == alone(engine, *wide)
    assert got[1] == alone(engine, *tall)
    assert got[0] != got[1]
    assert got[2][0] == "".join(r.text for r in engine.generate(text_only, GREEDY, 8))


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    def cached(reply):
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    lead = "Look here"
    ((start, end),) = image_prompt(engine, lead, TALL, QUESTION)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    first = chat_reply(client, lead, TALL, QUESTION)
    again = chat_reply(client, lead, TALL, QUESTION)
    assert cached(again) == BLOCK_SIZE * (first["usage"]["prompt_tokens"] // BLOCK_SIZE)
    assert again["choices"] == first["choices"]
    # Another image of the same tiles at the same place: no block from its start on.
    other = (lead, picture(100, 60, 4), QUESTION)
    reply = chat_reply(client, *other)
    assert cached(reply) == 0
    assert reply["choices"][0]["message"]["content"] == alone(engine, *other)[0]


def test_images_over_the_context_are_400_before_they_are_encoded(client, engine, monkeypatch):
    # 66 tokens each: the 8th passes the context of 512.
    assert engine.ctx_size == 512
    encoded = []
    encode_images = engine.encode_images

    def counted(images):
        encoded.extend(images)
        return encode_images(images)

    monkeypatch.setattr(engine, "encode_images", counted)
    wides = [picture(48, 150, seed) for seed in range(10, 18)]
    body = {"messages": [{"role": "user", "content": image_content(*wides)}], "max_tokens": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages.0.content.7.image_url.url"
    assert "take 528 tokens, more than the context of 512" in error["message"]
    assert len(encoded) == 7
