"""serve with images for Qianfan-OCR, on a tiny random QianfanOCRForConditionalGeneration
in the Hub's layout (internvl_helpers), whose chat template marks an image <image> and
whose images take InternVL's tiles, 16 tokens a tile between <img> and </img>. A greedy
chat completion with an image equals `llmrun run --image`'s tokens (the engine's
single-sequence loop) and transformers'; requests with images of other tile counts batched
together (in prefill chunks that would split an image) each get their reply alone; the
prefix cache reuses an image's blocks for the same image only (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import (
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
from internvl_helpers import greedy_tokens, processor_inputs, save_qianfan_ocr_dir, tiny_internvl
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 48x150: 3 tiles in a row and a thumbnail (66 tokens with <img> and </img>); 100x60: 2
# tiles in a column and a thumbnail (50).
WIDE, TALL = picture(48, 150, 1), picture(100, 60, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_internvl(text_type="qwen3", family="QianfanOCR")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qianfan_ocr_dir(model, tmp_path_factory.mktemp("qianfan_ocr"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "qianfan-ocr")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE)], QUESTION)
    expected = greedy_tokens(model, reference)
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, prompt_tokens)


def test_images_of_other_tile_counts_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=16)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, ("Look here", TALL, QUESTION), picture(100, 60, 4)
    )
