"""serve with images for GLM-OCR, on a tiny random GlmOcrForConditionalGeneration
(glm4v_helpers): a greedy chat completion with two images equals `llmrun run --image`'s
tokens and transformers' (image_serving's check); its tower is GLM-4.1V's variant, its
prompts and M-RoPE positions GLM-4.1V's, whose batching and prefix cache
test_serve_glm4v_images.py covers.

Tolerances: tokens and text exact.
"""

import pytest
from glm4v_helpers import greedy_tokens, processor_inputs, save_glm4v_dir, tiny_glm4v
from image_serving import check_reply_is_run_s
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in these pictures?"
# Patches of 14 merged 2x2: 56x84 is scaled up past the least pixels to 3x4 tokens,
# 140x224 takes 5x8.
WIDE, LARGE = picture(56, 84, 1), picture(140, 224, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_glm4v(kind="GlmOcr")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glm4v_dir(model, tmp_path_factory.mktemp("glm-ocr"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "glm-ocr")


def test_a_greedy_reply_to_two_images_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, LARGE, QUESTION)
    _, ids, _, _ = image_prompt(engine, WIDE, LARGE, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE), open_image(LARGE)], QUESTION)
    assert ids == reference.input_ids[0].tolist()
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(reply, engine, (WIDE, LARGE, QUESTION), expected, len(ids))
