"""serve with images for EXAONE 4.5, on a tiny random Exaone4_5_ForConditionalGeneration
(exaone4_5_helpers), whose images take one <|image_pad|> per merged token by their size
and whose tokens all turn by their place. A greedy chat completion with an image equals
`llmrun run --image`'s tokens (the engine's single-sequence loop) and transformers';
requests with images of other sizes batched together (in prefill chunks that would split
an image) each get their reply alone; the prefix cache reuses an image's blocks for the
same image only, also where the reused prefix ends inside it (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from exaone4_5_helpers import greedy_tokens, processor_inputs, save_exaone4_5_dir, tiny_exaone4_5
from image_serving import (
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in these pictures?"
# Sides rounded to 28 pixels (patches of 14 merged 2x2): 56x84 takes 2x3 tokens, 140x56
# 5x2, 140x168 5x6 (in four windows of at most 4x4).
WIDE, TALL, LARGE = picture(56, 84, 1), picture(140, 56, 2), picture(140, 168, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_exaone4_5()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_exaone4_5_dir(model, tmp_path_factory.mktemp("exaone4_5"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "exaone4_5")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, LARGE, QUESTION)
    reference = processor_inputs(folder, [open_image(LARGE)], QUESTION)
    expected = greedy_tokens(model, reference)
    # The prompt's tokens count the image's 30.
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (LARGE, QUESTION), expected, prompt_tokens)


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    wide, tall = (WIDE, "What is it?"), (TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 8 tokens would end inside each image.
    assert all(a < 8 < b for ((a, b),) in spans), spans
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=8)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    parts = (LARGE, QUESTION)
    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    assert start < BLOCK_SIZE < end  # the first block ends inside the image
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, parts, picture(140, 168, 4), "And what else is there?"
    )
    # The image's 30 tokens span two block ends: the rest after the second is fed;
    # another image of the same size at the same place: no block from its start on.
    assert end < 3 * BLOCK_SIZE and reused.again > 2 * BLOCK_SIZE
    assert (reused.other_question, reused.other_image) == (2 * BLOCK_SIZE, 0)
