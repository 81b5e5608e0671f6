"""serve with images for SmolVLM, on a tiny random SmolVLMForConditionalGeneration
(smolvlm_helpers), whose images take a number of tokens by their shape (tiles of <image>
tokens between row/column tokens, then the whole image). A greedy chat completion with an
image equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other grids batched together (in prefill chunks
that would split an image) each get their reply alone; the prefix cache reuses an image's
blocks for the same image only; images over the context are a 400 before they are
encoded; `llmrun serve FOLDER` loads the vision tower.

Tolerances: tokens and text exact.
"""

import httpx
import pytest
from serving import GREEDY, Server, alone, chat_reply, image_content, image_prompt, scheduled
from smolvlm_helpers import greedy_tokens, reference_inputs, save_smolvlm_dir, tiny_smolvlm
from starlette.testclient import TestClient
from vision_helpers import picture

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE
from llmrun.server import Service, create_app

pytest.importorskip("PIL")
pytest.importorskip("num2words")  # SmolVLMProcessor's
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 2x2 tiles (34 prompt tokens), 1x2 tiles (21), 2x1 tiles (22).
SQUARE, WIDE, TALL = picture(64, 64, 1), picture(30, 90, 2), picture(100, 17, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_smolvlm()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_smolvlm_dir(model, tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    service = Service("smolvlm", set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, SQUARE, QUESTION)
    text, tokens = alone(engine, SQUARE, QUESTION)
    rendered = image_prompt(engine, SQUARE, QUESTION)[0]
    reference = reference_inputs(folder, [open_image(SQUARE)], rendered)
    expected = greedy_tokens(model, reference)
    assert tokens == expected[: len(tokens)] and len(tokens) >= 4  # run stops at EOS
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == reference["input_ids"].shape[1]
    assert reply["usage"]["completion_tokens"] == len(tokens)


def image_request(engine, *parts) -> Request:
    _, ids, prompt_images, digests = image_prompt(engine, *parts)
    return Request(ids, GREEDY, 8, images=prompt_images, image_digests=digests)


def test_images_of_other_grids_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [len(s) for s in spans] == [1, 1] and spans[0] != spans[1]
    assert all(a < 16 < b for ((a, b),) in spans)
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = [image_request(engine, *wide), image_request(engine, *tall)]
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
    ((start, end),) = image_prompt(engine, lead, SQUARE, QUESTION)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    first = chat_reply(client, lead, SQUARE, QUESTION)
    again = chat_reply(client, lead, SQUARE, QUESTION)
    assert cached(again) == BLOCK_SIZE * (first["usage"]["prompt_tokens"] // BLOCK_SIZE)
    assert again["choices"] == first["choices"]
    # Another image of the same grid at the same place: no block from its start on.
    other_image = (lead, picture(64, 64, 4), QUESTION)
    reply = chat_reply(client, *other_image)
    assert cached(reply) == 0
    assert reply["choices"][0]["message"]["content"] == alone(engine, *other_image)[0]


def test_images_over_the_context_are_400_before_they_are_encoded(client, engine, monkeypatch):
    # 34 tokens each: the 16th passes the context of 512.
    assert engine.ctx_size == 512
    encoded = []
    encode_images = engine.encode_images

    def counted(images):
        encoded.extend(images)
        return encode_images(images)

    monkeypatch.setattr(engine, "encode_images", counted)
    squares = [picture(64, 64, seed) for seed in range(10, 26)]
    body = {"messages": [{"role": "user", "content": image_content(*squares)}], "max_tokens": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages.0.content.15.image_url.url"
    assert "take 544 tokens, more than the context of 512" in error["message"]
    assert len(encoded) == 15


def test_serve_loads_a_smolvlm_folder_s_vision_tower(folder, engine, tmp_path):
    server = Server(tmp_path, str(folder))
    try:
        assert "takes images" in server.log.read_text()
        body = {"messages": [{"role": "user", "content": image_content(TALL, QUESTION)}]}
        body.update(temperature=0, max_tokens=8)
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.stop()
    assert reply["choices"][0]["message"]["content"] == alone(engine, TALL, QUESTION)[0]
