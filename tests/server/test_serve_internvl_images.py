"""serve with images for InternVL, on a tiny random InternVLForConditionalGeneration
(internvl_helpers), whose images take a number of 64-pixel tiles by their size and shape
(a thumbnail after several), 16 tokens a tile between <img> and </img>. A greedy chat
completion with an image equals `llmrun run --image`'s tokens (the engine's single-sequence
loop) and transformers'; requests with images of other tile counts batched together (in
prefill chunks that would split an image) each get their reply alone; the prefix cache
reuses an image's blocks for the same image only; images over the context are a 400 before
they are encoded (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import (
    check_batched_replies_are_alone_s,
    check_images_over_the_context_are_400_before_encoding,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
from internvl_helpers import greedy_tokens, processor_inputs, save_internvl_dir, tiny_internvl
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

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
    yield from served(engine, "internvl")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE)], QUESTION)
    expected = greedy_tokens(model, reference)
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, prompt_tokens)


def test_images_of_other_tile_counts_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [b - a for ((a, b),) in spans] == [64, 48]
    assert all(a < 16 < b for ((a, b),) in spans)
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=16)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    parts = ("Look here", TALL, QUESTION)
    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    # Another image of the same tiles at the same place: no block from its start on.
    check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, parts, picture(100, 60, 4)
    )


def test_images_over_the_context_are_400_before_they_are_encoded(client, engine):
    # 66 tokens each: the 8th passes the context of 512.
    wides = [picture(48, 150, seed) for seed in range(10, 18)]
    check_images_over_the_context_are_400_before_encoding(
        client, engine, wides, tokens=528, context=512
    )
