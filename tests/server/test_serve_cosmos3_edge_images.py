"""serve with images for Cosmos3 Edge, on a tiny random Cosmos3EdgeForConditionalGeneration
(cosmos3_edge_helpers), whose images take one <|image_pad|> per merged token and turn, with
the text after them, by interleaved M-RoPE. A greedy chat completion with an image equals
`llmrun run --image`'s tokens (the engine's single-sequence loop) and transformers'; a
request with an image batched with others in prefill chunks that would split it gets its
reply alone (the M-RoPE shifts kept per row).

Tolerances: tokens and text exact.
"""

import pytest
from cosmos3_edge_helpers import processor_inputs, save_cosmos3_edge_dir, tiny_cosmos3_edge
from image_serving import check_batched_replies_are_alone_s, check_reply_is_run_s
from qwen2_vl_helpers import greedy_tokens
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# Sides rounded to 32 pixels (patches of 16 merged 2x2): 140x168 takes 4x5 tokens, 64x96
# 2x3, 140x56 4x2.
LARGE, WIDE, TALL = picture(140, 168, 3), picture(64, 96, 1), picture(140, 56, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_cosmos3_edge()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_cosmos3_edge_dir(model, tmp_path_factory.mktemp("cosmos3_edge"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "cosmos3_edge")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, LARGE, QUESTION)
    reference = processor_inputs(folder, [open_image(LARGE)], QUESTION)
    expected = greedy_tokens(model, reference)
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (LARGE, QUESTION), expected, prompt_tokens)


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    wide, tall = (WIDE, "What is it?"), (TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 36 tokens would end inside each image (after the system prompt's 34).
    assert all(a < 36 < b for ((a, b),) in spans), spans
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=36)
