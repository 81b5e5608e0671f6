"""serve with images for Granite Docling, on a tiny random
GraniteDoclingForConditionalGeneration (granite_docling_helpers), whose image tokens carry
DeepStack features into its Granite's first layers. A greedy chat completion with a page
of 2 x 2 tiles and its thumbnail equals `llmrun run --image`'s tokens (the engine's
single-sequence loop) and transformers'; so does a text-only one.

Tolerances: tokens and text exact.
"""

import pytest
import torch
from granite_docling_helpers import (
    reference_inputs,
    save_granite_docling_dir,
    tiny_granite_docling,
)
from image_serving import check_reply_is_run_s
from serving import GREEDY, chat_reply, served
from smolvlm_helpers import greedy_tokens
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image

pytest.importorskip("PIL")
pytest.importorskip("transformers")
QUESTION = "Convert this page to docling."
PAGE = picture(64, 60, 3)  # 2 x 2 tiles and the thumbnail


@pytest.fixture(scope="module")
def model():
    return tiny_granite_docling()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_granite_docling_dir(model, tmp_path_factory.mktemp("granite_docling"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "granite_docling")


def test_greedy_replies_to_a_page_and_to_text_are_run_s(client, engine, model, folder):
    reply = chat_reply(client, PAGE, QUESTION)
    text = engine.prompt_text(QUESTION, images=1)
    reference = reference_inputs(folder, [open_image(PAGE)], text)
    expected = greedy_tokens(model, reference)
    check_reply_is_run_s(reply, engine, (PAGE, QUESTION), expected, reference["input_ids"].shape[1])
    reply = chat_reply(client, QUESTION)
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    responses = list(engine.generate(ids, GREEDY, 8))
    assert [r.token for r in responses if r.token is not None] == greedy_tokens(
        model, {"input_ids": torch.tensor([ids])}
    )[: len(responses)]
    assert reply["choices"][0]["message"]["content"] == "".join(r.text for r in responses)
