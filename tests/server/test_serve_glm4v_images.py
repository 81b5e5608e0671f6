"""serve with images for GLM-4.1V, on a tiny random Glm4vForConditionalGeneration
(glm4v_helpers): an image's tokens take M-RoPE positions (in blocks over GLM's adjacent
pairs), and the text after an image turns by its place less a shift, which the paged cache
takes per row from the scheduler. A greedy chat completion with two images equals `llmrun
run --image`'s tokens and transformers'; requests with images of other sizes (other
shifts) batched with each other and with a text-only request, in prefill chunks of text
after an image, each get their reply alone; the prefix cache reuses an image's blocks for
the same image only, also where the reused prefix ends inside it (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from glm4v_helpers import greedy_tokens, processor_inputs, save_glm4v_dir, tiny_glm4v
from image_serving import (
    check_batched_replies_are_alone_s,
    check_other_shifts_after_the_images,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
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
    return tiny_glm4v()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glm4v_dir(model, tmp_path_factory.mktemp("glm4v"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "glm4v")


def test_a_greedy_reply_to_two_images_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, LARGE, QUESTION)
    _, ids, prompt_images, _ = image_prompt(engine, WIDE, LARGE, QUESTION)
    assert prompt_images.shift_at(len(ids)) < 0  # the text after them is shifted
    reference = processor_inputs(folder, [open_image(WIDE), open_image(LARGE)], QUESTION)
    assert ids == reference.input_ids[0].tolist()
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(reply, engine, (WIDE, LARGE, QUESTION), expected, len(ids))


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    after = "What is it, and what is beside it?"
    wide, large = ("Look here", WIDE, after), ("Look here", LARGE, after)
    check_other_shifts_after_the_images(engine, wide, large)
    check_batched_replies_are_alone_s(engine, wide, large, prefill_budget=8)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    # 64 prompt tokens: the last block's last token is fed again for its logits.
    check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, (LARGE, QUESTION), picture(140, 224, 3), "And what else is there?"
    )
