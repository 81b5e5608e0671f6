"""serve with images for Ovis2.5, on a tiny random Ovis2_5ForConditionalGeneration
(ovis2_5_helpers), whose images take their start and end indicator embeddings around one
image token per merged token. A greedy chat completion with an image equals
`llmrun run --image`'s tokens (the engine's single-sequence loop) and transformers'.

Tolerances: tokens and text exact.
"""

import pytest
from exaone4_5_helpers import greedy_tokens
from image_serving import check_reply_is_run_s
from ovis2_5_helpers import processor_inputs, save_ovis2_5_dir, tiny_ovis2_5
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 64x48 pixels, 4x3 merged tokens: one window, where transformers 5.25's order is Ovis's.
IMAGE = picture(60, 50, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_ovis2_5()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_ovis2_5_dir(model, tmp_path_factory.mktemp("ovis2_5"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "ovis2_5")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, IMAGE, QUESTION)
    reference = processor_inputs(folder, [open_image(IMAGE)], QUESTION)
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(
        reply, engine, (IMAGE, QUESTION), expected, reference["input_ids"].shape[1]
    )
