"""serve with images for Llama 4, on a tiny random Llama4ForConditionalGeneration
(llama4_vision_helpers), whose images take a grid of 84-pixel tiles by their size and shape
(the whole image after several), 9 <|patch|> tokens a tile with separators between tiles. A
greedy chat completion with an image equals `llmrun run --image`'s tokens (the engine's
single-sequence loop) and transformers'; requests with images of other grids batched
together (in prefill chunks that would split an image) each get their reply alone
(image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import check_batched_replies_are_alone_s, check_reply_is_run_s
from llama4_vision_helpers import greedy_tokens, model_inputs, save_llama4_dir, tiny_llama4
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 100x260: 2 x 3 tiles and the whole image (72 tokens from <|image_start|> to
# <|image_end|>); 200x90: 3 x 2 tiles and the whole image (72).
WIDE, TALL = picture(100, 260, 3), picture(200, 90, 4)


@pytest.fixture(scope="module")
def model():
    return tiny_llama4()


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    folder = save_llama4_dir(model, tmp_path_factory.mktemp("llama4"))
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "llama4")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model):
    """transformers' reference: llmrun's ids and pixels, which tests/models/
    test_llama4_vision.py holds to the processor's."""
    from llmrun.images import open_image

    reply = chat_reply(client, WIDE, QUESTION)
    _, ids, _, _ = image_prompt(engine, WIDE, QUESTION)
    expected = greedy_tokens(model, model_inputs(engine.vision, ids, [open_image(WIDE)]))
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, len(ids))


def test_images_of_other_grids_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # From the first <|patch|> to the last: 7 tiles of 9 and the 7 separators between.
    assert [b - a for ((a, b),) in spans] == [70, 70]
    assert all(a < 16 < b for ((a, b),) in spans)
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=16)
