"""serve with images for Mistral 3, on a tiny random Mistral3ForConditionalGeneration with
its Pixtral tower (pixtral_helpers), whose images take a number of tokens by their size
(rows of [IMG], [IMG_BREAK] between rows, [IMG_END]). A greedy chat completion with an
image equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other sizes batched together (in prefill chunks
that would split an image) each get their reply alone; the prefix cache reuses an
image's blocks for the same image only, also where the reused prefix ends inside it;
images over the context are a 400 before they are encoded; `llmrun serve FOLDER` loads
the vision tower.

Tolerances: tokens and text exact.
"""

import httpx
import pytest
from pixtral_helpers import greedy_tokens, reference_inputs, save_mistral3_dir, tiny_mistral3
from serving import GREEDY, Server, alone, chat_reply, image_content, image_prompt, scheduled
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
# Sides rounded up to 28 pixels (patches of 14 merged 2x2), within 84: 56x84 is 2 rows of
# 3 tokens, 100x60 3 rows of 2, 84x84 3 rows of 3.
WIDE, TALL, SQUARE = picture(56, 84, 1), picture(100, 60, 2), picture(84, 84, 3)
WIDE_EXPANSION = "[IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG_END]"


@pytest.fixture(scope="module")
def model():
    return tiny_mistral3()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_mistral3_dir(model, tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    service = Service("mistral3", set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    text, tokens = alone(engine, WIDE, QUESTION)
    rendered = image_prompt(engine, WIDE, QUESTION)[0]
    reference = reference_inputs(folder, [open_image(WIDE)], rendered, [WIDE_EXPANSION])
    expected = greedy_tokens(model, reference)
    assert tokens == expected[: len(tokens)] and len(tokens) >= 4  # run stops at EOS
    assert reply["choices"][0]["message"]["content"] == text
    # The prompt's tokens count the image's 8.
    assert reply["usage"]["prompt_tokens"] == reference["input_ids"].shape[1]
    assert reply["usage"]["completion_tokens"] == len(tokens)


def image_request(engine, *parts) -> Request:
    _, ids, prompt_images, digests = image_prompt(engine, *parts)
    return Request(ids, GREEDY, 8, images=prompt_images, image_digests=digests)


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 8 tokens would end inside each image.
    assert [len(s) for s in spans] == [1, 1] and spans[0] != spans[1]
    assert all(a < 8 < b for ((a, b),) in spans)
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = [image_request(engine, *wide), image_request(engine, *tall)]
    requests.append(Request(text_only, GREEDY, 8))
    got = scheduled(Scheduler(engine, parallel=3, prefill_budget=8), requests)
    assert got[0] == alone(engine, *wide)
    assert got[1] == alone(engine, *tall)
    assert got[0] != got[1]
    assert got[2][0] == "".join(r.text for r in engine.generate(text_only, GREEDY, 8))


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    def cached(reply):
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    lead = "Look here, look here"
    ((start, end),) = image_prompt(engine, lead, SQUARE, QUESTION)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    first = chat_reply(client, lead, SQUARE, QUESTION)
    again = chat_reply(client, lead, SQUARE, QUESTION)
    assert cached(again) == BLOCK_SIZE * (first["usage"]["prompt_tokens"] // BLOCK_SIZE)
    assert cached(again) > BLOCK_SIZE and again["choices"] == first["choices"]
    # The rest of the image after the reused block is fed.
    other_question = (lead, SQUARE, "And what else is there?")
    reply = chat_reply(client, *other_question)
    assert cached(reply) == BLOCK_SIZE
    assert reply["choices"][0]["message"]["content"] == alone(engine, *other_question)[0]
    # Another image of the same size at the same place: no block from its start on.
    other_image = (lead, picture(84, 84, 4), "And what else is there?")
    reply = chat_reply(client, *other_image)
    assert cached(reply) == 0
    assert reply["choices"][0]["message"]["content"] == alone(engine, *other_image)[0]


def test_images_over_the_context_are_400_before_they_are_encoded(client, engine, monkeypatch):
    # 12 tokens each: the 22nd passes the context of 256.
    assert engine.ctx_size == 256
    encoded = []
    encode_images = engine.encode_images

    def counted(images):
        encoded.extend(images)
        return encode_images(images)

    monkeypatch.setattr(engine, "encode_images", counted)
    squares = [picture(84, 84, seed) for seed in range(10, 32)]
    body = {"messages": [{"role": "user", "content": image_content(*squares)}], "max_tokens": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages.0.content.21.image_url.url"
    assert "take 264 tokens, more than the context of 256" in error["message"]
    assert len(encoded) == 21


def test_serve_loads_a_mistral3_folder_s_vision_tower(folder, engine, tmp_path):
    server = Server(tmp_path, str(folder))
    try:
        assert "takes images" in server.log.read_text()
        body = {"messages": [{"role": "user", "content": image_content(TALL, QUESTION)}]}
        body.update(temperature=0, max_tokens=8)
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.stop()
    assert reply["choices"][0]["message"]["content"] == alone(engine, TALL, QUESTION)[0]
