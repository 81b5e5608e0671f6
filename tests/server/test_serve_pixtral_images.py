"""serve with images for Mistral 3, on a tiny random Mistral3ForConditionalGeneration with
its Pixtral tower (pixtral_helpers), whose images take a number of tokens by their size
(rows of [IMG], [IMG_BREAK] between rows, [IMG_END]). A greedy chat completion with an
image equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other sizes batched together (in prefill chunks
that would split an image) each get their reply alone; the prefix cache reuses an
image's blocks for the same image only, also where the reused prefix ends inside it;
images over the context are a 400 before they are encoded; `llmrun serve FOLDER` loads
the vision tower (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import (
    check_batched_replies_are_alone_s,
    check_images_over_the_context_are_400_before_encoding,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
    served_process_reply,
)
from pixtral_helpers import greedy_tokens, reference_inputs, save_mistral3_dir, tiny_mistral3
from serving import alone, chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

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
    yield from served(engine, "mistral3")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    rendered = image_prompt(engine, WIDE, QUESTION)[0]
    reference = reference_inputs(folder, [open_image(WIDE)], rendered, [WIDE_EXPANSION])
    expected = greedy_tokens(model, reference)
    # The prompt's tokens count the image's 8.
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, prompt_tokens)


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 8 tokens would end inside each image.
    assert [len(s) for s in spans] == [1, 1] and spans[0] != spans[1]
    assert all(a < 8 < b for ((a, b),) in spans)
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=8)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    parts = ("Look here, look here", SQUARE, QUESTION)
    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, parts, picture(84, 84, 4), "And what else is there?"
    )
    # The rest of the image after the reused block is fed; another image of the same
    # size at the same place: no block from its start on.
    assert reused.again > BLOCK_SIZE
    assert (reused.other_question, reused.other_image) == (BLOCK_SIZE, 0)


def test_images_over_the_context_are_400_before_they_are_encoded(client, engine):
    # 12 tokens each: the 22nd passes the context of 256.
    squares = [picture(84, 84, seed) for seed in range(10, 32)]
    check_images_over_the_context_are_400_before_encoding(
        client, engine, squares, tokens=264, context=256
    )


def test_serve_loads_a_mistral3_folder_s_vision_tower(folder, engine, tmp_path):
    reply = served_process_reply(tmp_path, [str(folder)], TALL, QUESTION)
    assert reply == alone(engine, TALL, QUESTION)[0]
