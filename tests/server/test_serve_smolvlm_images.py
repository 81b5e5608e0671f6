"""serve with images for SmolVLM, on a tiny random SmolVLMForConditionalGeneration
(smolvlm_helpers), whose images take a number of tokens by their shape (tiles of <image>
tokens between row/column tokens, then the whole image). A greedy chat completion with an
image equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other grids batched together (in prefill chunks
that would split an image) each get their reply alone; the prefix cache reuses an image's
blocks for the same image only; images over the context are a 400 before they are
encoded; `llmrun serve FOLDER` loads the vision tower (image_serving's checks).

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
from serving import alone, chat_reply, image_prompt, served
from smolvlm_helpers import greedy_tokens, reference_inputs, save_smolvlm_dir, tiny_smolvlm
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

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
    yield from served(engine, "smolvlm")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, SQUARE, QUESTION)
    rendered = image_prompt(engine, SQUARE, QUESTION)[0]
    reference = reference_inputs(folder, [open_image(SQUARE)], rendered)
    expected = greedy_tokens(model, reference)
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (SQUARE, QUESTION), expected, prompt_tokens)


def test_images_of_other_grids_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [len(s) for s in spans] == [1, 1] and spans[0] != spans[1]
    assert all(a < 16 < b for ((a, b),) in spans)
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=16)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    parts = ("Look here", SQUARE, QUESTION)
    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    # Another image of the same grid at the same place: no block from its start on.
    check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, parts, picture(64, 64, 4)
    )


def test_images_over_the_context_are_400_before_they_are_encoded(client, engine):
    # 34 tokens each: the 16th passes the context of 512.
    squares = [picture(64, 64, seed) for seed in range(10, 26)]
    check_images_over_the_context_are_400_before_encoding(
        client, engine, squares, tokens=544, context=512
    )


def test_serve_loads_a_smolvlm_folder_s_vision_tower(folder, engine, tmp_path):
    reply = served_process_reply(tmp_path, [str(folder)], TALL, QUESTION)
    assert reply == alone(engine, TALL, QUESTION)[0]
