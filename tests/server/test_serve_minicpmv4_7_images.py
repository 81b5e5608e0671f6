"""serve with images for MiniCPM-V 4.7, on a tiny random MiniCPMV4_7ForConditionalGeneration
(minicpmv_helpers): each image's frame (from <image> to its last </slice>) takes canvas
M-RoPE positions, and the text after it turns by its place less a shift, which the paged
cache takes per row from the scheduler. A greedy chat completion with an image equals
`llmrun run --image`'s tokens and transformers'; requests with images of other slice grids
(other shifts) batched with each other and with a text-only request, in prefill chunks of
text after an image, each get their reply alone (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import (
    check_batched_replies_are_alone_s,
    check_other_shifts_after_the_images,
    check_reply_is_run_s,
)
from minicpmv_helpers import greedy_tokens, reference_inputs, save_minicpmv_dir, tiny_minicpmv
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 2x2 slices (a canvas of 4x4 tokens), 1x3 slices (2x6).
SQUARE, WIDE = picture(64, 64, 1), picture(30, 90, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_minicpmv(version="4.7")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_minicpmv_dir(model, tmp_path_factory.mktemp("minicpmv4_7"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "minicpmv4_7")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, SQUARE, QUESTION)
    rendered, ids, prompt_images, _ = image_prompt(engine, SQUARE, QUESTION)
    assert prompt_images.shift_at(len(ids)) < 0  # the text after it is shifted
    reference = reference_inputs(folder, [open_image(SQUARE)], rendered)
    assert ids == reference["input_ids"][0].tolist()
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(reply, engine, (SQUARE, QUESTION), expected, len(ids))


def test_images_of_other_grids_batched_together_each_get_their_own_reply(engine):
    square, wide = ("Look here", SQUARE, "What is it?"), ("Look here", WIDE, "What is it?")
    check_other_shifts_after_the_images(engine, square, wide)
    check_batched_replies_are_alone_s(engine, square, wide, prefill_budget=8)
