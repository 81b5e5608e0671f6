"""serve with images for Kimi K2.5, on a tiny random Kimi_K25ForConditionalGeneration
(kimi_k25_helpers), whose images take one <|media_pad|> per merged token by their size. A
greedy chat completion with an image equals `llmrun run --image`'s tokens (the engine's
single-sequence loop) and transformers' (on the processor's ids, stored in GOLDEN);
requests with images of other sizes batched together (in prefill chunks that would split
an image) each get their reply alone; the prefix cache reuses an image's blocks for the
same image only, also where the reused prefix ends inside it (image_serving's checks).

Tolerances: tokens and text exact.
"""

import json

import pytest
from image_serving import (
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
from kimi_k25_helpers import (
    GOLDEN,
    GOLDEN_QUESTION,
    greedy_tokens,
    reference_inputs,
    save_kimi_k25_dir,
    tiny_kimi_k25,
)
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
# GOLDEN's last image (8x10 patches, 20 tokens); 40x60 (4x6 patches, 6 tokens); 100x150
# shrunk to 10 patches a side (8x10, 20 tokens); 130x130 shrunk to 64 patches, then padded
# to 10x10 (25 tokens).
WIDE, SMALL, LARGE = picture(90, 120, 4), picture(40, 60, 1), picture(100, 150, 2)
SQUARE = picture(130, 130, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_kimi_k25()


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    folder = save_kimi_k25_dir(model, tmp_path_factory.mktemp("kimi_k25"))
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "kimi_k25")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model):
    reply = chat_reply(client, WIDE, GOLDEN_QUESTION)
    ids = json.loads(GOLDEN.read_text())[3]["input_ids"]
    assert image_prompt(engine, WIDE, GOLDEN_QUESTION)[1] == ids
    expected = greedy_tokens(model, reference_inputs(engine, ids, [open_image(WIDE)]))
    check_reply_is_run_s(reply, engine, (WIDE, GOLDEN_QUESTION), expected, len(ids))


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    small, large = (SMALL, "What is it?"), (LARGE, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (small, large)]
    # Chunks of 16 tokens would end inside each image.
    assert all(a < 16 < b for ((a, b),) in spans), spans
    check_batched_replies_are_alone_s(engine, small, large, prefill_budget=16)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    parts = (SQUARE, GOLDEN_QUESTION)
    ((start, end),) = image_prompt(engine, *parts)[2].spans()
    assert start < BLOCK_SIZE < 2 * BLOCK_SIZE < end  # two blocks end inside the image
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, parts, picture(130, 130, 5), "And what else is there?"
    )
    # The rest of the image after the reused blocks is fed; another image of the same
    # size at the same place: no block from its start on.
    assert reused.again > 2 * BLOCK_SIZE
    assert (reused.other_question, reused.other_image) == (2 * BLOCK_SIZE, 0)
