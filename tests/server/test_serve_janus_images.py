"""serve with images for Janus-Pro, on a tiny random JanusForConditionalGeneration
(janus_helpers), whose images take <begin_of_image>, one <image_placeholder> per patch and
<end_of_image>. A greedy chat completion with an image equals `llmrun run --image`'s tokens
(the engine's single-sequence loop) and transformers'; requests with different images
batched together (in prefill chunks that would split an image) each get their reply alone;
the prefix cache reuses an image's blocks for the same image only, also where the reused
prefix ends inside it (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import (
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
from janus_helpers import greedy_tokens, processor_inputs, save_janus_dir, tiny_janus
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in the picture?"
WIDE, TALL = picture(20, 45, 1), picture(50, 27, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_janus()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_janus_dir(model, tmp_path_factory.mktemp("janus"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "janus")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE)], QUESTION)
    expected = greedy_tokens(model, reference)
    # The prompt's tokens count the image's 16 and the two around them.
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, prompt_tokens)


def test_images_batched_together_each_get_their_own_reply(engine):
    wide, tall = (WIDE, "What is it?"), (TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 128 tokens would end inside each image (after the system prompt).
    assert all(a < 128 < b for ((a, b),) in spans), spans
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=128)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    parts = (TALL, QUESTION)
    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    assert (start // BLOCK_SIZE + 1) * BLOCK_SIZE < end, (start, end)  # a block ends in it
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, parts, picture(50, 27, 3), "And what else is there?"
    )
    assert reused.again > start
    assert reused.other_image == start // BLOCK_SIZE * BLOCK_SIZE
