"""serve with images for Ovis2, on a tiny random Ovis2ForConditionalGeneration
(ovis2_helpers), whose images take a thumbnail and tiles of <IMG_ATOM>s between marker
tokens that take the visual table's indicator embeddings. A greedy chat completion with
an image equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'.

Tolerances: tokens and text exact.
"""

import pytest
from exaone4_5_helpers import greedy_tokens
from image_serving import check_reply_is_run_s
from ovis2_helpers import processor_inputs, save_ovis2_dir, tiny_ovis2
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
IMAGE = picture(40, 90, 3)  # a thumbnail and 3x2 tiles


@pytest.fixture(scope="module")
def model():
    return tiny_ovis2()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_ovis2_dir(model, tmp_path_factory.mktemp("ovis2"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "ovis2")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, IMAGE, QUESTION)
    reference = processor_inputs(folder, [open_image(IMAGE)], QUESTION)
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(
        reply, engine, (IMAGE, QUESTION), expected, reference["input_ids"].shape[1]
    )
