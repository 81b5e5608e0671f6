"""serve with images for Granite 4 Vision, on a tiny random
Granite4VisionForConditionalGeneration (granite4_vision_helpers), whose image tokens carry
one stream for each decoder layer that takes the image in. A greedy chat completion with an
image equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other token counts batched together (in prefill
chunks that would split an image) each get their reply alone (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from granite4_vision_helpers import processor_inputs, save_granite4_vision_dir, tiny_granite4_vision
from image_serving import check_batched_replies_are_alone_s, check_reply_is_run_s
from llava_helpers import greedy_tokens
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 50x90: in a 64x64 pinpoint, 16 + 4 rows of 8 + a newline (52 tokens); 100x40: in a 64x32
# one, 16 + 8 rows of 4 + a newline (56).
WIDE, TALL = picture(50, 90, 1), picture(100, 40, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_granite4_vision()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_granite4_vision_dir(model, tmp_path_factory.mktemp("granite4_vision"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "granite4-vision")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE)], QUESTION)
    expected = greedy_tokens(model, reference)
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, prompt_tokens)


def test_images_of_other_token_counts_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [b - a for ((a, b),) in spans] == [52, 56]
    assert all(a < 16 < b for ((a, b),) in spans)
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=16)
