"""serve with images for HunYuan-VL (HunyuanOCR), on a tiny random
HunYuanVLForConditionalGeneration (hunyuan_vl_helpers): an image's tokens take XD-RoPE
positions (column, row, image index) and the text after it turns by its place, unshifted.
A greedy chat completion with two images equals `llmrun run --image`'s tokens (the
engine's single-sequence loop) and transformers'; requests with images of other sizes
batched with each other and with a text-only request, in prefill chunks of 8, each get
their reply alone; the prefix cache reuses an image's blocks for the same image only; an
image HunYuan-VL refuses (too long for its width) is a 400 on its field; `llmrun serve
FOLDER` loads the vision tower (image_serving's checks).

Tolerances: tokens and text exact.
"""

import pytest
from hunyuan_vl_helpers import (
    greedy_tokens,
    processor_inputs,
    save_hunyuan_vl_dir,
    tiny_hunyuan_vl,
)
from image_serving import (
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
    served_process_reply,
)
from serving import alone, chat_reply, image_content, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in these pictures?"
# Sides rounded to 32 pixels (patches of 16 merged 2x2): 64x96 takes 2 rows of 3 tokens
# and a newline each, with begin and end 10 tokens; 160x224 5x(7+1)+2 = 42.
WIDE, LARGE = picture(64, 96, 1), picture(160, 224, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_hunyuan_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_hunyuan_vl_dir(model, tmp_path_factory.mktemp("hunyuan-vl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "hunyuan-vl")


def test_a_greedy_reply_to_two_images_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, LARGE, QUESTION)
    _, ids, prompt_images, _ = image_prompt(engine, WIDE, LARGE, QUESTION)
    assert prompt_images.shift_at(len(ids)) == 0  # the text after them is at its place
    reference = processor_inputs(folder, [open_image(WIDE), open_image(LARGE)], QUESTION)
    assert ids == reference.input_ids[0].tolist()
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(reply, engine, (WIDE, LARGE, QUESTION), expected, len(ids))


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    wide, large = ("Look here", WIDE, "What is it?"), ("Look here", LARGE, "What is it?")
    check_batched_replies_are_alone_s(engine, wide, large, prefill_budget=8)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    ((_, end),) = image_prompt(engine, LARGE, QUESTION)[2].spans()
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, (LARGE, QUESTION), picture(160, 224, 3)
    )
    assert reused.again > end


def test_an_image_hunyuan_vl_refuses_is_a_400_on_its_field(client):
    body = {"messages": [{"role": "user", "content": image_content(picture(8, 2000, 5))}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.0.image_url.url"
    assert "at most 200 times as long as they are wide" in error["message"]


def test_serve_loads_a_hunyuan_vl_folder_s_vision_tower(folder, engine, tmp_path):
    reply = served_process_reply(tmp_path, [str(folder)], WIDE, QUESTION)
    assert reply == alone(engine, WIDE, QUESTION)[0]
