"""serve with images for Gemma 4, on a tiny random Gemma4ForConditionalGeneration
(gemma4_vision_helpers): images of other sizes take other numbers of soft tokens, which
see each other both ways on the sliding layer. A greedy chat completion with two images
equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other sizes batched with each other and with a
text-only request, in prefill chunks that would split an image, each get their reply
alone; the prefix cache reuses an image's blocks for the same image only (image_serving's
checks).

Tolerances: tokens and text exact.
"""

import pytest
from gemma4_vision_helpers import (
    greedy_tokens,
    processor_inputs,
    save_gemma4_vl_dir,
    tiny_gemma4_vl,
)
from helpers import needs_templates
from image_serving import (
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
)
from serving import chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
pytestmark = needs_templates
QUESTION = "What is in these pictures?"
# Resized to fill 70 tokens of 3x3 patches of 4 pixels whatever their size: 6x10 and
# 10x6 tokens, and 3x18 of a long strip.
WIDE, TALL, STRIP = picture(48, 80, 1), picture(100, 60, 2), picture(24, 120, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma4_vl_dir(model, tmp_path_factory.mktemp("gemma4-vl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "gemma4")


def test_a_greedy_reply_to_two_images_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, TALL, QUESTION)
    _, ids, _, _ = image_prompt(engine, WIDE, TALL, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE), open_image(TALL)], QUESTION)
    assert ids == reference.input_ids[0].tolist()
    # The template closes an empty thought; the answer after it is sent without its
    # leading space (llmrun.reasoning).
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(
        reply, engine, (WIDE, TALL, QUESTION), expected, len(ids), whole=True, lstrip=True
    )


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    wide, strip = ("Look here", WIDE, "What is it?"), ("Look here", STRIP, "What is it?")
    lengths = []
    for parts in (wide, strip):
        _, _, prompt_images, _ = image_prompt(engine, *parts)
        ((start, end),) = prompt_images.spans()
        assert start % 8 and end - start > 8  # chunks of 8 would split it
        lengths.append(end - start)
    assert lengths == [60, 54]
    check_batched_replies_are_alone_s(engine, wide, strip, prefill_budget=8)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    ((_, end),) = image_prompt(engine, TALL, QUESTION)[2].spans()
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, (TALL, QUESTION), picture(100, 60, 4)
    )
    assert reused.again > end
