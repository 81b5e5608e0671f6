"""serve with images for LFM2-VL, on a tiny random Lfm2VlForConditionalGeneration
(lfm2_vl_helpers), whose images take a number of tokens by their size (one frame, or tiles
between row/column tokens and a thumbnail) and whose language model keeps a convolution
state. A greedy chat completion with an image equals `llmrun run --image`'s tokens (the
engine's single-sequence loop) and transformers'; requests with images of other layouts
batched together (in prefill chunks that would split an image) each get their reply
alone.

Tolerances: tokens and text exact.
"""

import pytest
from lfm2_vl_helpers import greedy_tokens, model_inputs, save_lfm2_vl_dir, tiny_lfm2_vl
from serving import GREEDY, alone, chat_reply, image_prompt, scheduled
from starlette.testclient import TestClient
from vision_helpers import picture

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.images import open_image
from llmrun.server import Service, create_app

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 2 x 2 tiles and a thumbnail (35 prompt tokens); one frame of 2 x 4 tokens (10); 3 x 1
# tiles and a thumbnail (30).
SQUARE, WIDE, TALL = picture(200, 300, 1), picture(30, 90, 2), picture(300, 120, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_lfm2_vl()


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    folder = save_lfm2_vl_dir(model, tmp_path_factory.mktemp("lfm2_vl"))
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    service = Service("lfm2-vl", set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model):
    reply = chat_reply(client, SQUARE, QUESTION)
    text, tokens = alone(engine, SQUARE, QUESTION)
    ids = image_prompt(engine, SQUARE, QUESTION)[1]
    expected = greedy_tokens(model, model_inputs(engine.vision, ids, [open_image(SQUARE)]))
    assert tokens == expected[: len(tokens)] and len(tokens) >= 4  # run stops at EOS
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["usage"]["completion_tokens"] == len(tokens)


def image_request(engine, *parts) -> Request:
    _, ids, prompt_images, digests = image_prompt(engine, *parts)
    return Request(ids, GREEDY, 8, images=prompt_images, image_digests=digests)


def test_images_of_other_layouts_batched_together_each_get_their_own_reply(engine):
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
