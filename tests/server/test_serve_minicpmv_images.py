"""serve with images for MiniCPM-V 4.6, on a tiny random MiniCPMV4_6ForConditionalGeneration
(minicpmv_helpers), whose images take a number of tokens by their shape (the whole image,
then its slices) and whose language model keeps a recurrent state (Qwen3.5's Gated
DeltaNet layers). A greedy chat completion with an image equals `llmrun run --image`'s
tokens (the engine's single-sequence loop) and transformers'; requests with images of
other slice grids batched together (in prefill chunks that would split an image) each
get their reply alone.

Tolerances: tokens and text exact.
"""

import pytest
from minicpmv_helpers import greedy_tokens, reference_inputs, save_minicpmv_dir, tiny_minicpmv
from serving import (
    GREEDY,
    alone,
    chat_reply,
    image_prompt,
    image_request,
    scheduled,
    served,
)
from vision_helpers import picture

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 2x2 slices, 1x3 slices, 3x1 slices.
SQUARE, WIDE, TALL = picture(64, 64, 1), picture(30, 90, 2), picture(100, 17, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_minicpmv()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_minicpmv_dir(model, tmp_path_factory.mktemp("minicpmv"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "minicpmv")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, SQUARE, QUESTION)
    text, tokens = alone(engine, SQUARE, QUESTION)
    rendered = image_prompt(engine, SQUARE, QUESTION)[0]
    reference = reference_inputs(folder, [open_image(SQUARE)], rendered)
    expected = greedy_tokens(model, reference)
    assert tokens == expected[: len(tokens)] and len(tokens) >= 4  # run stops at EOS
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == reference["input_ids"].shape[1]
    assert reply["usage"]["completion_tokens"] == len(tokens)


def test_images_of_other_grids_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [len(s) for s in spans] == [1, 1] and spans[0] != spans[1]
    assert all(a < 16 < b for ((a, b),) in spans)
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = [image_request(engine, *wide), image_request(engine, *tall)]
    requests.append(Request(text_only, GREEDY, 8))
    got = scheduled(Scheduler(engine, parallel=3, prefill_budget=16), requests)
    assert got[0] == alone(engine, *wide)
    assert got[1] == alone(engine, *tall)
    assert got[0] != got[1]
    assert got[2][0] == "".join(r.text for r in engine.generate(text_only, GREEDY, 8))
