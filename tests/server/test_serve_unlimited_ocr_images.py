"""serve with images for Unlimited-OCR, on a tiny random UnlimitedOcrForConditionalGeneration
(unlimited_ocr_helpers), whose images here (none over a crop's 640 pixels) take the whole
view's 16 rows of 16 tokens and a newline, and the view separator, in the place of 273
<image> tokens. A greedy chat completion with an image equals `llmrun run --image`'s
tokens (the engine's single-sequence loop) and transformers'; requests with different
images batched together (in prefill chunks that would split an image) each get their
reply alone; the prefix cache reuses an image's blocks for the same image only, also where
the reused prefix ends inside it (image_serving's checks). Crops are checked in
tests/models/test_unlimited_ocr_vision.py.

Tolerances: tokens and text exact.
"""

import pytest
from deepseek_ocr2_helpers import greedy_tokens
from image_serving import (
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
from serving import chat_reply, image_prompt, served
from unlimited_ocr_helpers import processor_inputs, save_unlimited_ocr_dir, tiny_unlimited_ocr
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is written here?"
WIDE, TALL, SQUARE = picture(300, 500, 1), picture(500, 300, 2), picture(400, 400, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_unlimited_ocr()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_unlimited_ocr_dir(model, tmp_path_factory.mktemp("unlimited_ocr"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "unlimited_ocr")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE)], QUESTION)
    expected = greedy_tokens(model, reference)
    # The prompt's tokens count the image's 273.
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, prompt_tokens)


def test_images_batched_together_each_get_their_own_reply(engine):
    wide, tall = (WIDE, "What is it?"), (TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert all(a < 16 < b for ((a, b),) in spans), spans
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=16)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    parts = (SQUARE, QUESTION)
    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, parts, picture(400, 400, 4), "And what else is there?"
    )
    # The rest of the image after the reused blocks is fed; another image of the same
    # size at the same place: no block from its start on.
    assert reused.again > BLOCK_SIZE
    assert reused.other_image == 0
