"""serve with images for LFM2-VL, on a tiny random Lfm2VlForConditionalGeneration
(lfm2_vl_helpers), whose images take a number of tokens by their size (one frame, or tiles
between row/column tokens and a thumbnail) and whose language model keeps a convolution
state. A greedy chat completion with an image equals `llmrun run --image`'s tokens (the
engine's single-sequence loop) and transformers'; requests with images of other layouts
batched together (in prefill chunks that would split an image) each get their reply
alone (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import check_batched_replies_are_alone_s, check_reply_is_run_s
from lfm2_vl_helpers import greedy_tokens, model_inputs, save_lfm2_vl_dir, tiny_lfm2_vl
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

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
    yield from served(engine, "lfm2-vl")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model):
    reply = chat_reply(client, SQUARE, QUESTION)
    ids = image_prompt(engine, SQUARE, QUESTION)[1]
    expected = greedy_tokens(model, model_inputs(engine.vision, ids, [open_image(SQUARE)]))
    check_reply_is_run_s(reply, engine, (SQUARE, QUESTION), expected, len(ids))


def test_images_of_other_layouts_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [len(s) for s in spans] == [1, 1] and spans[0] != spans[1]
    assert all(a < 16 < b for ((a, b),) in spans)
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=16)
