"""serve with images for HyperCLOVA X SEED Vision, on a tiny random
HyperCLOVAXVisionV2ForConditionalGeneration (hyperclovax_vision_helpers), whose images
take one <|image_pad|> per merged token and are scaled by the language model's
embedding_multiplier as its text is. A greedy chat completion with an image equals
`llmrun run --image`'s tokens (the engine's single-sequence loop) and transformers'.

Tolerances: tokens and text exact.
"""

import pytest
from exaone4_5_helpers import greedy_tokens
from hyperclovax_vision_helpers import (
    processor_inputs,
    save_hyperclovax_vision_dir,
    tiny_hyperclovax_vision,
)
from image_serving import check_reply_is_run_s
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
LARGE = picture(140, 168, 3)  # 5x6 merged tokens, in four windows of at most 4x4


@pytest.fixture(scope="module")
def model():
    return tiny_hyperclovax_vision()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_hyperclovax_vision_dir(model, tmp_path_factory.mktemp("hyperclovax_vision"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "hyperclovax_vision")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, LARGE, QUESTION)
    reference = processor_inputs(folder, [open_image(LARGE)], QUESTION)
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(
        reply, engine, (LARGE, QUESTION), expected, reference["input_ids"].shape[1]
    )
