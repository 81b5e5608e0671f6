"""serve with images for GLM-4.1V, on a tiny random Glm4vForConditionalGeneration
(glm4v_helpers): an image's tokens take M-RoPE positions (in blocks over GLM's adjacent
pairs), and the text after an image turns by its place less a shift, which the paged cache
takes per row from the scheduler. A greedy chat completion with two images equals `llmrun
run --image`'s tokens and transformers'; requests with images of other sizes (other
shifts) batched with each other and with a text-only request, in prefill chunks of text
after an image, each get their reply alone; the prefix cache reuses an image's blocks for
the same image only, also where the reused prefix ends inside it.

Tolerances: tokens and text exact.
"""

import pytest
from glm4v_helpers import processor_inputs, save_glm4v_dir, tiny_glm4v
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
QUESTION = "What is in these pictures?"
# Patches of 14 merged 2x2: 56x84 is scaled up past the least pixels to 3x4 tokens,
# 140x224 takes 5x8.
WIDE, LARGE = picture(56, 84, 1), picture(140, 224, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_glm4v()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glm4v_dir(model, tmp_path_factory.mktemp("glm4v"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    service = Service("glm4v", set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_a_greedy_reply_to_two_images_is_run_s_and_transformers(client, engine, model, folder):
    import torch

    reply = chat_reply(client, WIDE, LARGE, QUESTION)
    text, tokens = alone(engine, WIDE, LARGE, QUESTION)
    _, ids, prompt_images, _ = image_prompt(engine, WIDE, LARGE, QUESTION)
    assert prompt_images.shift_at(len(ids)) < 0  # the text after them is shifted
    reference = processor_inputs(folder, [open_image(WIDE), open_image(LARGE)], QUESTION)
    assert ids == reference.input_ids[0].tolist()
    with torch.no_grad():
        out = model.generate(**reference, max_new_tokens=8, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    assert tokens == expected[: len(tokens)] and len(tokens) >= 4  # run stops at EOS
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["usage"]["completion_tokens"] == len(tokens)


def image_request(engine, *parts) -> Request:
    _, ids, prompt_images, digests = image_prompt(engine, *parts)
    return Request(ids, GREEDY, 8, images=prompt_images, image_digests=digests)


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    after = "What is it, and what is beside it?"
    wide, large = ("Look here", WIDE, after), ("Look here", LARGE, after)
    shifts = []
    for parts in (wide, large):
        _, ids, prompt_images, _ = image_prompt(engine, *parts)
        ((start, end),) = prompt_images.spans()
        assert start % 8 and end % 8 and len(ids) - end > 8  # chunks of text after it
        shifts.append(prompt_images.shift_at(len(ids)))
    assert shifts[0] != shifts[1] and min(shifts) < 0
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = [image_request(engine, *wide), image_request(engine, *large)]
    requests.append(Request(text_only, GREEDY, 8))
    got = scheduled(Scheduler(engine, parallel=3, prefill_budget=8), requests)
    assert got[0] == alone(engine, *wide)
    assert got[1] == alone(engine, *large)
    assert got[0] != got[1]
    assert got[2][0] == "".join(r.text for r in engine.generate(text_only, GREEDY, 8))


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    def cached(reply):
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    ((start, end),) = image_prompt(engine, LARGE, QUESTION)[2].spans()
    inside = (start // BLOCK_SIZE + 1) * BLOCK_SIZE  # a block ends inside the image
    assert inside < end
    first = chat_reply(client, LARGE, QUESTION)
    again = chat_reply(client, LARGE, QUESTION)
    # Whole blocks, the last token fed again for its logits (64 tokens: 3 blocks).
    assert cached(again) == BLOCK_SIZE * ((first["usage"]["prompt_tokens"] - 1) // BLOCK_SIZE)
    assert again["choices"] == first["choices"]
    # Another question: the image's first blocks are reused, its rest fed.
    other_question = (LARGE, "And what else is there?")
    reply = chat_reply(client, *other_question)
    assert inside <= cached(reply) < end
    assert reply["choices"][0]["message"]["content"] == alone(engine, *other_question)[0]
    # Another image of the same size at the same place: no block from its start on.
    other_image = (picture(140, 224, 3), "And what else is there?")
    reply = chat_reply(client, *other_image)
    assert cached(reply) == start // BLOCK_SIZE * BLOCK_SIZE
    assert reply["choices"][0]["message"]["content"] == alone(engine, *other_image)[0]
